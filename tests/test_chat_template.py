"""ourobatch.chat_template: loading a checkpoint's template(s) the way Hugging Face does, and rendering
with HF's environment. Expected strings are written out by hand from the templates' own text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ourobatch.chat_template import ChatTemplate, conversations, load_chat_template, render, template_override

# ChatML, as Qwen-style checkpoints ship it
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def write(folder: Path, **files: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        path = folder / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value if isinstance(value, str) else json.dumps(value))
    return folder


def test_chatml_renders_as_written():
    assert render(CHATML, CHAT) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    assert render(CHATML, CHAT, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_tokenizer_config_string_with_special_tokens(tmp_path):
    folder = write(tmp_path, **{"tokenizer_config.json": {
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        "bos_token": {"content": "<s>", "lstrip": False, "special": True}, "eos_token": "</s>"}})
    template = load_chat_template(folder)
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert template.render(CHAT) == "<s>be brief</s>hi</s>"


def test_named_templates_and_the_files_beside_them(tmp_path):
    folder = write(tmp_path, **{"tokenizer_config.json": {"chat_template": [
        {"name": "default", "template": "config-default"},
        {"name": "tool_use", "template": "tools: {{ tools | tojson }}"},
        {"name": "rag", "template": "{% for d in documents %}[{{ d.title }}]{% endfor %}"}]}})
    t = load_chat_template(folder)
    assert t.render(CHAT) == "config-default"
    assert t.render(CHAT, tools=[{"name": "f"}]) == 'tools: [{"name": "f"}]'  # HF picks tool_use with tools
    assert t.render(CHAT, name="rag", documents=[{"title": "a"}, {"title": "b"}]) == "[a][b]"
    with pytest.raises(ValueError, match="'nope' is not one of"):
        t.render(CHAT, name="nope")
    # chat_template.jinja replaces the default; additional_chat_templates/ adds named ones
    write(folder, **{"chat_template.jinja": "jinja-default", "additional_chat_templates__short.jinja": "short"})
    t = load_chat_template(folder)
    assert t.render(CHAT) == "jinja-default" and t.render(CHAT, name="short") == "short"
    assert t.render(CHAT, name="rag", documents=[]) == ""


def test_no_template_and_malformed_ones(tmp_path):
    assert load_chat_template(write(tmp_path / "none", **{"tokenizer_config.json": {"eos_token": "</s>"}})) is None
    assert load_chat_template(tmp_path / "empty-folder") is None
    with pytest.raises(ValueError, match="chat_template must be a string or a list"):
        load_chat_template(write(tmp_path / "bad", **{"tokenizer_config.json": {"chat_template": 3}}))
    with pytest.raises(ValueError, match="cannot read"):
        load_chat_template(write(tmp_path / "json", **{"tokenizer_config.json": "{not json"}))


def test_hf_globals_filters_and_extensions():
    assert render("{{ raise_exception('no system role') if messages[0].role == 'system' }}x", CHAT[1:]) == "x"
    with pytest.raises(ValueError, match="no system role"):
        render("{{ raise_exception('no system role') if messages[0].role == 'system' }}", CHAT)
    assert len(render("{{ strftime_now('%Y-%m-%d') }}", CHAT)) == 10
    assert (render("{{ messages[0] | tojson }}", [{"role": "user", "content": "é"}])
            == '{"role": "user", "content": "é"}')
    assert render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}", CHAT) == '{"a": 2, "b": 1}'
    assert render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
                  CHAT) == "system"
    assert render("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
                  CHAT) == "be briefhi"
    # trim_blocks / lstrip_blocks: a block tag's own line leaves no newline or indent behind
    assert render("{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}",
                  CHAT) == "system\nuser\n"
    assert render("{{ greeting }} {{ bos_token }}", CHAT, special_tokens={"bos_token": "<s>"},
                  chat_template_kwargs={"greeting": "hello"}) == "hello <s>"


def test_the_sandbox_refuses_to_reach_python_internals():
    with pytest.raises(ValueError, match="chat template"):
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}", CHAT)
    with pytest.raises(ValueError, match="chat template"):
        render("{% set x = messages.append(1) %}", CHAT)  # immutable: no mutation of the caller's list


def test_message_checks_and_text_parts():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render("{{ messages[0].content }}", parts) == "a\nb"
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].*image_url"):
        render("x", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    with pytest.raises(ValueError, match=r"messages\[1\].role"):
        render("x", [CHAT[0], {"content": "no role"}])
    with pytest.raises(TypeError, match="non-empty list"):
        render("x", [])
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        render("x", ["hi"])
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        render("x", CHAT, chat_template_kwargs={"add_generation_prompt": False})


def test_continue_final_message_ends_the_prompt_inside_the_last_message():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    assert render(CHATML, chat, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello, I am")
    with pytest.raises(ValueError, match="cannot both be true"):
        render(CHATML, chat, continue_final_message=True)
    with pytest.raises(ValueError, match="does not appear"):
        render("{{ messages[0].content }}", chat, add_generation_prompt=False, continue_final_message=True)


def test_override_from_a_file_or_text(tmp_path):
    folder = write(tmp_path / "tok", **{"tokenizer_config.json": {"eos_token": "</s>"}})
    path = write(tmp_path, **{"t.jinja": "{{ messages[0].content }}{{ eos_token }}"}) / "t.jinja"
    t = template_override(str(path), folder)
    assert t.render(CHAT) == "be brief</s>" and t.origin == str(path)
    assert template_override("{{ 'inline' }}", None).render(CHAT) == "inline"
    with pytest.raises(ValueError, match="no such file"):
        template_override(str(tmp_path / "missing.jinja"), folder)
    with pytest.raises(ValueError, match="does not compile"):
        template_override("{% if %}", folder)


def test_one_conversation_or_many():
    assert conversations(CHAT) == [CHAT]
    assert conversations([CHAT, CHAT[1:]]) == [CHAT, CHAT[1:]]
    with pytest.raises(TypeError):
        conversations("hi")
    assert ChatTemplate({"only": "x"}, "here").select() == "x"  # one template, whatever its name
    with pytest.raises(ValueError, match="none is 'default'"):
        ChatTemplate({"a": "x", "b": "y"}, "here").select()
