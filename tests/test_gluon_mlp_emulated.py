"""The decode step's MLP launch (engine/gluon_mlp.py's mlp_kernel: the add + norm after attention, gate_up + SiLU
and down_proj as one warp-specialized Gluon kernel, launched by launch_mlp where mlp_dispatch.mlp_folds) run on the
CPU by tests/gluon_emulator.py. Checked against a float64 reference written here from the model's description
(the shared OURO.md, engine/model.py's OuroDecoderLayer.run): from o_proj's K-split float32 partials o, the
residual rows h and the layer's weights,

    h_mid = h + rms(o, input_layernorm_2)        x = rms(h_mid, post_attention_layernorm)
    act = silu(x gate.T) * (x up.T)              pd = act down.T (float32: the next kernel adds its norm)

every output the launch writes (h_mid, act, pd and its counters: the grid barrier's count and generation, and each
chunk group's count of gate_up tiles, never reset across launches), at several shapes (rows, hidden, intermediate
sizes with one or two chunk groups, K splits, CTA counts, ring depths, GROUPS on and off, bf16 and fp16), with the
rows past the live ones left as they were; and that the result does not depend on timing (other TMA orders, half
of the CTAs lagging, each partition lagging after its mbarrier arrives: bit-identical outputs). Where Triton is
installed (CI installs it); acquire / release ordering is the GPU tests' (tests/gpu)."""

from __future__ import annotations

import time

import pytest
import torch

from engine import mlp_dispatch

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
from engine import gluon_mlp  # noqa: E402

EPS = 1e-6
ROWS = mlp_dispatch.MLP_ROWS  # every row buffer holds this many rows; the launch writes only the live ones
GROUP_TILES = mlp_dispatch.MLP_GROUP_CHUNKS * mlp_dispatch.MLP_BLOCK_K // mlp_dispatch.MLP_BLOCK_N  # 16-column tiles
# Tolerances, in unit roundoffs u of the 16-bit dtype (bf16: 8 significant bits, u = 2^-8; fp16: 11, u = 2^-11).
# The kernel rounds as the model's 16-bit path does: h_mid after rms(o), its product with the weight and the sum; act
# after x, gate, up and SiLU x up (each rounding at most u relative, of random sign); pd sums act in float32. A
# simulation of those roundings over 40 seeds at these shapes and Ouro-1.4B's gives at most 2.3u in norm and 16u
# elementwise against |want| + the tensor's rms (act's worst: gate near 0 with a large up, gate's absolute error from
# x's rounding times up). So: 4u in norm and 32u elementwise (bf16: 1.6e-2 and 0.125), which a wrong tile (16 of
# SiLU x up's columns, or of down's) fails in norm and one wrong element of typical size fails elementwise.
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # OURO.md's RMSNorm, in float64: w * x / sqrt(mean(x^2) + eps)
    return w * x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()


class Case:
    """Random inputs of one launch: o_proj's float32 partials [splits, rows, hidden], the residual rows, the two
    norms' weights, gate_up [2 x inter, hidden] (gate's rows, then up's) and down [hidden, inter]; and output
    buffers of ROWS rows filled with NaN (a live element never written stays NaN, and so must the rows past
    `rows`)."""

    def __init__(self, rows: int, hidden: int, inter: int, splits: int, seed: int, dtype=torch.bfloat16) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows, self.hidden, self.inter, self.dtype = rows, hidden, inter, dtype
        self.partials = torch.randn(splits, rows, hidden, generator=g) / splits
        self.h = torch.randn(rows, hidden, generator=g).to(dtype)
        self.w_branch, self.w_next = ((1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype) for _ in range(2))
        self.w_gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
        self.w_down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(dtype)
        self.h_mid = torch.full((ROWS, hidden), float("nan"), dtype=dtype)
        self.act = torch.full((ROWS, inter), float("nan"), dtype=dtype)
        self.pd = torch.full((1, ROWS, hidden), float("nan"))
        self.barrier = mlp_dispatch.new_counters("cpu")

    def run(self, ctas: int, groups: int = 1, stages: int = mlp_dispatch.MLP_STAGES, seed: int = 0,
            slow: float = 0.0, arrive_lag: tuple[int, float] | None = None, check_global: bool = False) -> None:
        """One launch on `ctas` CTAs with launch_mlp's arguments (its output tensors are the live rows of ours)."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        w_layout, x_layout, chunk_layout = gluon_mlp.smem_layouts(self.dtype, self.hidden)
        chunks_a, chunks_b = mlp_dispatch.chunk_split(self.inter)
        box = [mlp_dispatch.MLP_BLOCK_N, mlp_dispatch.MLP_BLOCK_K]
        emulator.emulate(
            gluon_mlp.mlp_kernel, ctas, TensorDescriptor.from_tensor(self.w_gate_up, box, w_layout),
            TensorDescriptor.from_tensor(self.w_down, box, w_layout), self.partials, self.h, self.w_branch,
            self.w_next, self.h_mid, self.act, self.pd, self.barrier, self.partials.stride(0),
            self.partials.shape[0], self.rows, EPS, seed=seed, slow=slow, arrive_lag=arrive_lag,
            check_global=check_global, x_layout=x_layout, chunk_layout=chunk_layout, H=self.hidden, I=self.inter,
            CHUNKS_A=chunks_a, CHUNKS_B=chunks_b, STAGES=stages, USE_PDL=True, num_warps=mlp_dispatch.MLP_WARPS,
            DIAG=0, GROUPS=groups)

    def reference(self) -> dict[str, torch.Tensor]:
        o = self.partials.double().sum(0)  # o_proj(a): its K splits summed
        h_mid = self.h.double() + rms(o, self.w_branch.double())
        x = rms(h_mid, self.w_next.double())
        w = self.w_gate_up.double()
        gate, up = x @ w[:self.inter].T, x @ w[self.inter:].T
        act = gate * torch.sigmoid(gate) * up  # SiLU(gate) x up
        return {"h_mid": h_mid, "act": act, "pd": act @ self.w_down.double().T}

    def outputs(self) -> dict[str, torch.Tensor]:
        return {"h_mid": self.h_mid, "act": self.act, "pd": self.pd[0]}

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.h_mid, self.act, self.pd, self.barrier)]


def tile_counts(inter: int) -> list[int]:
    # gate_up's 16-column tiles of SiLU x up per chunk group (8 chunks of 256 columns: 128 tiles), MLP_MAX_GROUPS
    counts = [0] * mlp_dispatch.MLP_MAX_GROUPS
    for t in range(inter // mlp_dispatch.MLP_BLOCK_N):
        counts[t // GROUP_TILES] += 1
    return counts


def wrap32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def counters_after(launches: int, inter: int, start: int = 0) -> list[int]:
    # the arrival count back at 0, the generation one more a launch, each group's count its tiles more a launch
    return [0, wrap32(start + launches)] + [wrap32((start + launches) * n) for n in tile_counts(inter)]


def errors(case: Case) -> dict[str, tuple[float, float]]:
    """Per output: its live rows' error against float64 in units of u, in norm (relative) and elementwise (against
    |want| + the tensor's rms)."""
    ref, u = case.reference(), UNIT[case.dtype]
    out = {}
    for name, got in case.outputs().items():
        live, want = got[:case.rows].double(), ref[name]
        assert bool(torch.isfinite(live).all()), f"{name}: NaN in the live rows (never written, or from act read early)"
        diff = live - want
        scale = want.abs() + want.pow(2).mean().sqrt()
        out[name] = (float(diff.norm() / want.norm()) / u, float((diff.abs() / scale).max()) / u)
    return out


def assert_matches_float64(case: Case) -> None:
    errs = errors(case)
    assert all(norm < 4 and elementwise < 32 for norm, elementwise in errs.values()), errs
    for name, got in case.outputs().items():  # the rows past the live ones: untouched (still NaN)
        assert bool(torch.isnan(got[case.rows:]).all()), f"{name}: a row past the live ones was written"


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.flatten().view(torch.uint8), y.flatten().view(torch.uint8)) for x, y in zip(a, b))


# rows, hidden, inter, splits, CTAs, GROUPS, ring stages, dtype
SHAPES = {
    # 10 chunks of 256: two groups (8 + 2; CHUNKS_A 8 + CHUNKS_B 2), 160 gate_up tiles; 6 CTAs, so h_mid's shares
    # (43 columns) run past hidden in the last CTA; half of the CTAs lagging; the ring of 4 slots wraps
    "two_groups": (5, 256, 2560, 2, 6, 1, 4, torch.bfloat16),
    # every row, hidden 512 (2 K steps a gate_up tile), 3 chunks (2 + 1) in one group, 3 splits, 20 CTAs (2 or 3
    # gate_up tiles each, 1 or 2 down tiles), fp16, the default ring
    "full_rows_fp16": (8, 512, 768, 3, 20, 1, mlp_dispatch.MLP_STAGES, torch.float16),
    # GROUPS off (the grid barrier before SiLU x up is staged), one row, one split, 20 CTAs for 16 down tiles (4
    # CTAs without one), a ring of 2
    "grid_barrier": (1, 256, 512, 1, 20, 0, 2, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_launch_matches_float64(name):
    rows, hidden, inter, splits, ctas, groups, stages, dtype = SHAPES[name]
    assert mlp_dispatch.mlp_fold_applies(rows, hidden, inter, stages)  # a shape the engine launches it at
    case = Case(rows, hidden, inter, splits, seed=list(SHAPES).index(name), dtype=dtype)
    case.run(ctas, groups, stages, seed=1, slow=0.002, check_global=True)
    assert_matches_float64(case)
    assert case.barrier.tolist() == counters_after(1, inter)


def test_launch_mlp_passes_what_the_tests_pass(monkeypatch):
    # launch_mlp itself, its kernel launch run by the emulator on 6 "SMs": the same bits as Case.run's mirror of its
    # arguments (so the tests above launch what the engine launches)
    grids = []

    class Launcher:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: emulator.emulate(kernel, grid, *args, seed=2, **kwargs)

    kernel = gluon_mlp.mlp_kernel
    monkeypatch.setattr(gluon_mlp, "mlp_kernel", Launcher())
    monkeypatch.setattr(gluon_mlp.pdl, "num_sms", lambda device: 6)
    case = Case(5, 256, 2560, 2, seed=40)
    h_mid, pd = gluon_mlp.launch_mlp(case.h, case.partials, case.w_branch, case.w_next, case.w_gate_up, case.w_down,
                                     case.barrier, EPS, stages=4)
    assert grids == [(6,)] and h_mid.shape == (5, 256) and pd.shape == (1, 5, 256)
    monkeypatch.undo()
    barrier = case.barrier.clone()
    case.barrier = mlp_dispatch.new_counters("cpu")
    case.run(6, stages=4, seed=3)
    assert_matches_float64(case)
    assert same_bits([h_mid, pd, barrier], [case.h_mid[:5], case.pd[:, :5], case.barrier])


def test_the_reference_is_the_models_layer():
    # the float64 reference above, completed with the add + norm after the MLP (the next kernel's), is the engine
    # model's decoder layer (OuroDecoderLayer.run in float64, its attention's output o given)
    from engine.config import OuroConfig
    from engine.model import OuroDecoderLayer

    case = Case(3, 256, 512, 2, seed=11)
    config = OuroConfig.from_dict(dict(model_type="ouro", vocab_size=67, hidden_size=256, intermediate_size=512,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                       head_dim=128))
    layer = OuroDecoderLayer(config, 0).double()
    w_post = 1 + 0.2 * torch.randn(256, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    with torch.no_grad():
        layer.input_layernorm_2.weight.copy_(case.w_branch.double())
        layer.post_attention_layernorm.weight.copy_(case.w_next.double())
        layer.post_attention_layernorm_2.weight.copy_(w_post)
        layer.mlp.gate_proj.weight.copy_(case.w_gate_up[:512].double())
        layer.mlp.up_proj.weight.copy_(case.w_gate_up[512:].double())
        layer.mlp.down_proj.weight.copy_(case.w_down.double())
        want = layer.run(case.h.double(), lambda x: case.partials.double().sum(0))
    ref = case.reference()
    got = ref["h_mid"] + rms(ref["pd"], w_post)
    assert float((got - want).norm() / want.norm()) < 1e-12


def test_the_counters_carry_across_launches_and_wrap():
    # the counters are never reset: each launch (fresh inputs, GROUPS on, off, on) waits for its own tiles,
    # (generation + 1) x a group's tiles. From generation 2^24 - 1, whose first group's count (x 128 tiles) is just
    # short of 2^31: the first launch waits for a count that wraps to -2^31 (int32 arithmetic that wraps, as the
    # kernel's comparison does; one that did not would stage SiLU x up's rows before they are written: still NaN)
    start = 2**24 - 1
    barrier = torch.tensor(counters_after(0, 2560, start), dtype=torch.int32)
    for launch, groups in enumerate((1, 0, 1)):
        case = Case(4, 256, 2560, 2, seed=20 + launch)
        case.barrier = barrier
        case.run(8, groups, stages=4, seed=launch, slow=0.002)
        assert_matches_float64(case)
        assert barrier.tolist() == counters_after(launch + 1, 2560, start), barrier.tolist()


# the timing runs' shape: 9 chunks (two groups, 8 + 1), 16 CTAs (9 gate_up tiles and one down tile each: 27 weight
# boxes, so a lag after each arrive costs each partition about 27 lags)
TIMING = (3, 256, 2304, 2)
LAG = 0.05  # seconds after each arrive


def timing_run(**kwargs) -> Case:
    case = Case(*TIMING, seed=30)
    case.run(16, 1, 4, **kwargs)
    return case


def test_the_result_does_not_depend_on_the_ctas_timing():
    # other TMA landing orders, and either half of the CTAs lagging after each mbarrier wait (after a first run
    # that matches float64)
    first = timing_run(seed=0)
    assert_matches_float64(first)
    assert first.barrier.tolist() == counters_after(1, TIMING[2])
    for seed, slow in ((1, 0.0), (2, 0.003), (3, 0.003)):
        assert same_bits(timing_run(seed=seed, slow=slow).snapshot(), first.snapshot()), (seed, slow)


@pytest.mark.parametrize("partition,arrives", [(0, 10), (1, 27), (2, 27)])
def test_the_result_does_not_depend_on_a_partitions_lag_after_its_arrives(partition, arrives):
    # partition 0 the stager (x_ready after the normed rows, then each of the 9 SiLU x up chunks' signal), 1 the
    # consumer (each of its 27 ring slots given back), 2 the loader (each of its 27 slots' expect): sleeping after
    # each arrive, so that what it does after a signal lands late; a reader relying on the signal too early would
    # see it missing. (The run takes at least a CTA's arrives x the lag: the lag reached the partition named.)
    base = timing_run(seed=4).snapshot()
    start = time.monotonic()
    lagged = timing_run(seed=4, arrive_lag=(partition, LAG)).snapshot()
    assert time.monotonic() - start >= arrives * LAG
    assert same_bits(lagged, base)
