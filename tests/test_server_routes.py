"""The app's route table: create_app composes one router per concern (issue 23 item 6), and the split
must serve exactly the (method, path) pairs the single create_app served before it. EXPECTED was
written down from the app at ce14def (before the split), not derived from the code under test."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from ourobatch import EngineConfig
from ourobatch.server.app import create_app
from tests.server_helpers import MODEL

EXPECTED = {
    # OpenAI (completions.py, chat.py)
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    # SGLang's token-in / token-out generation
    ("POST", "/generate"),
    # vLLM's tokenizer routes (tokenization.py)
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
    # SGLang's control routes (control_routes.py)
    ("POST", "/abort_request"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
    ("POST", "/update_weights_from_disk"), ("GET", "/get_weight_version"),
    ("GET", "/flush_cache"), ("POST", "/flush_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
    ("GET", "/release_memory_occupation"), ("POST", "/release_memory_occupation"),
    ("GET", "/resume_memory_occupation"), ("POST", "/resume_memory_occupation"),
    ("GET", "/get_model_info"), ("GET", "/model_info"), ("GET", "/get_server_info"), ("GET", "/server_info"),
    # health and metrics
    ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/metrics"),
    # FastAPI's schema route (docs_url and redoc_url are off)
    ("GET", "/openapi.json"), ("HEAD", "/openapi.json"),
}


def _walk(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path) of every route, through included routers (FastAPI >= 0.16x keeps them as one
    entry holding the original router; older releases copy their routes into the app's list)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _walk(included.routes, prefix + route.include_context.prefix)
            continue
        for method in route.methods:
            yield method, prefix + route.path


def route_table(app: Any) -> set[tuple[str, str]]:
    pairs = list(_walk(app.routes))
    assert len(pairs) == len(set(pairs)), f"a (method, path) is routed twice: {sorted(pairs)}"
    return set(pairs)


def test_the_route_table_is_the_one_before_the_split():
    table = route_table(create_app(EngineConfig(model=str(MODEL))))
    assert table - EXPECTED == set(), "new routes"
    assert EXPECTED - table == set(), "routes lost"
