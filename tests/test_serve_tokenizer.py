"""The served model's text as vLLM makes it, checked against Hugging Face's tokenizer and chat template (the
outside reference): a completion's prompt gets the tokenizer's BOS, output text skips special tokens unless a
request asks for them, a chat template renders as ``apply_chat_template`` renders it (bos_token,
raise_exception, whitespace control; sandboxed), and the server answers to ``--model`` as given."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.util import char_tokenizer

transformers = pytest.importorskip("transformers")

# A Llama-2-style template: BOS from the tokenizer, a system prompt folded into the first turn, a role it does not
# know refused with raise_exception, {%- -%} and trim_blocks/lstrip_blocks deciding every newline
TEMPLATE = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% endif %}
{{ bos_token }}
{% for m in messages %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles are user and assistant, got ' + m['role']) }}
    {% endif %}
    {%- if m['role'] == 'user' -%}
[INST] {% if loop.first and system is defined %}<<SYS>>{{ system }}<</SYS>> {% endif %}{{ m['content'] }} [/INST]
    {%- else -%}
 {{ m['content'] }}{{ eos_token }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
 {% endif %}"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tokenizer of one character per id whose post-processor adds BOS, as Llama's does, with the template."""
    d = tmp_path_factory.mktemp("tok")
    fast = char_tokenizer("abcdefghijklmnopqrstuvwxyz []/<>INSTY!?.,", "<pad>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(d)
    return d


def test_a_completion_prompt_gets_the_tokenizers_bos_and_a_chat_its_templates(checkpoint):
    from harness.serve.tokenizer import CheckpointTokenizer

    ours, hf = CheckpointTokenizer(checkpoint), transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert ours.encode("hi there") == hf("hi there").input_ids and ours.encode("hi there")[0] == 1  # vLLM: BOS
    assert ours.encode("hi", add_special_tokens=False) == hf("hi", add_special_tokens=False).input_ids


def test_output_text_skips_special_tokens_unless_asked(checkpoint):
    from harness.serve.tokenizer import CheckpointTokenizer, IncrementalText

    ours, hf = CheckpointTokenizer(checkpoint), transformers.AutoTokenizer.from_pretrained(checkpoint)
    ids = [*ours.encode("ok", add_special_tokens=False), 2]  # the model's EOS at the end
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "ok"  # vLLM's default
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids) == "ok</s>"
    stream = IncrementalText(ours)
    assert stream.add(ids[:1]) + stream.add(ids[1:]) + stream.flush() == "ok"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and?"}],
])
def test_a_chat_template_renders_as_apply_chat_template(checkpoint, messages):
    from harness.serve.tokenizer import CheckpointTokenizer

    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert CheckpointTokenizer(checkpoint).chat(messages) == want
    assert want.startswith("<s>")  # (the template's bos_token: the test means something)


def test_a_template_that_raises_or_reaches_out_is_stopped(checkpoint, tmp_path):
    import shutil

    import jinja2

    from harness.serve.tokenizer import CheckpointTokenizer

    with pytest.raises(jinja2.exceptions.TemplateError, match="roles are user and assistant"):
        CheckpointTokenizer(checkpoint).chat([{"role": "tool", "content": "x"}])
    d = tmp_path / "evil"
    shutil.copytree(checkpoint, d)
    (d / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")  # an escape, refused
    with pytest.raises(jinja2.exceptions.SecurityError):
        CheckpointTokenizer(d).chat([{"role": "user", "content": "hi"}])


def test_the_server_answers_to_the_model_as_given_and_to_each_served_name():
    """vLLM names the model by --model as given (a client's ``-m DIR`` must work), not its base name;
    --served-model-name adds names, the first of which a response carries."""
    from harness.serve.command import served_names

    args = argparse.Namespace(served_model_name=None)
    opts = argparse.Namespace(device="cpu", model="/data/models/Llama-2-7b-hf", model_spec="tiny")
    assert served_names(opts, args) == ["/data/models/Llama-2-7b-hf"]
    args.served_model_name = ["llama", "l2"]
    assert served_names(opts, args) == ["llama", "l2", "/data/models/Llama-2-7b-hf"]
    opts.device = "sim"
    assert served_names(opts, argparse.Namespace(served_model_name=None)) == ["tiny"]


def test_a_chat_template_renders_without_transformers_loaded(checkpoint):
    """The server never imports transformers: the environment must load what it uses itself (jinja2's loop
    controls live in ``jinja2.ext``, which ``import jinja2`` does not load)."""
    import subprocess
    import sys

    code = ("import sys; from harness.serve.tokenizer import CheckpointTokenizer; "
            f"t = CheckpointTokenizer({str(checkpoint)!r}); print(t.chat([{{'role': 'user', 'content': 'hi'}}])); "
            "assert 'transformers' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "[INST] hi [/INST]" in p.stdout, p.stderr


def test_a_template_that_refuses_the_messages_is_a_400_and_a_model_is_found_by_any_name(checkpoint):
    """The front end's request parsing: a chat whose template raises is the client's error (400, vLLM's shape),
    not a server fault; a request may name the model by any served name; another name is vLLM's 404."""
    from types import SimpleNamespace

    from harness.serve.app import BadRequest, FrontEnd
    from harness.serve.tokenizer import CheckpointTokenizer

    engine = SimpleNamespace(name="inflight", opts=SimpleNamespace(max_seq_len=256),
                             executor=SimpleNamespace(kv_offload_blocks=0),
                             strategy=SimpleNamespace(rejection=lambda r: None))
    fe = FrontEnd(engine, CheckpointTokenizer(checkpoint), ["llama", str(checkpoint)])
    with pytest.raises(BadRequest, match="the chat template: TemplateError: roles are user and assistant") as e:
        fe._request({"messages": [{"role": "tool", "content": "x"}]}, chat=True)
    assert e.value.status == 400
    for name in ("llama", str(checkpoint)):
        r, _ = fe._request({"model": name, "messages": [{"role": "user", "content": "hi"}]}, chat=True)
        assert r.prompt_token_ids[0] == 1 and r.prompt_token_ids[1] != 1  # the template's bos_token, once
    with pytest.raises(BadRequest) as e:
        fe._request({"model": "other", "prompt": "hi"}, chat=False)
    assert e.value.status == 404
