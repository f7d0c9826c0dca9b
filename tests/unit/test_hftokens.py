"""A model's tokenizer and chat template applied as vLLM applies them (precise prefix routing), and
fetched from a hub (a loopback one here) by the gateway's tokenizer shelf."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from gateway.server.tokenizers import Tokenizers
from llmgw.engines.hftokens import ChatTokenizer, TokenizerUnavailable, fetch
from llmgw.state.records import EndpointInfo
from harness.fakehub import FakeHub

VOCAB = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "be", "brief", "hi",
         "there", "\n"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tokenizer_files(tmp_path, template=CHATML, bos="<s>"):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"\n| "), behavior="isolated")
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": template, "bos_token": {"content": bos}, "eos_token": "</s>"}))
    return path, cfg


def ids(*words):
    return [VOCAB.index(w) for w in words]


def test_a_chat_is_the_rendered_template_encoded_without_adding_special_tokens(tmp_path):
    t = ChatTokenizer.from_files(*tokenizer_files(tmp_path))
    got = t.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    nl = VOCAB.index("\n")
    assert [x for x in got if x != VOCAB.index("<unk>")] == (
        ids("<|im_start|>", "system") + [nl] + ids("be", "brief", "<|im_end|>") + [nl]
        + ids("<|im_start|>", "user") + [nl] + ids("hi", "<|im_end|>") + [nl] + ids("<|im_start|>", "assistant") + [nl])
    assert got[0] != VOCAB.index("<s>")  # the template, not the encoder, decides about BOS in a chat


def test_a_completion_prompt_gets_the_models_special_tokens_and_token_ids_pass(tmp_path):
    t = ChatTokenizer.from_files(*tokenizer_files(tmp_path))
    assert t.prompt("hi there")[0] == VOCAB.index("<s>")
    assert t.prompt(["hi"]) == t.prompt("hi")
    assert t.prompt([5, 6, 7]) == [5, 6, 7]
    assert t.prompt({"x": 1}) is None


def test_a_template_list_uses_its_default_and_raise_exception_refuses_quietly(tmp_path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}" + CHATML
    t = ChatTokenizer.from_files(*tokenizer_files(tmp_path, template=[{"name": "tool_use", "template": "x"},
                                                                      {"name": "default", "template": strict}]))
    assert t.chat([{"role": "system", "content": "be"}]) is None
    assert t.chat([{"role": "user", "content": "hi"}])


def test_a_broken_template_or_tokenizer_is_unavailable_with_the_reason(tmp_path):
    with pytest.raises(TokenizerUnavailable, match="does not compile"):
        ChatTokenizer.from_files(*tokenizer_files(tmp_path, template="{% for %}"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(TokenizerUnavailable, match="not a tokenizer"):
        ChatTokenizer.from_files(bad, None)
    # No chat template: completions only.
    tok, _ = tokenizer_files(tmp_path)
    assert ChatTokenizer.from_files(tok, None).chat([{"role": "user", "content": "hi"}]) is None


@pytest.fixture
def hub():
    h = FakeHub().start()
    yield h
    h.stop()


def test_the_shelf_loads_from_the_hub_and_the_request_path_only_looks_up(tmp_path, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    tok, cfg = tokenizer_files(tmp_path)
    hub.add_repo("org/chat", {"tokenizer.json": tok.read_bytes(), "tokenizer_config.json": cfg.read_bytes()})
    shelf = Tokenizers({"HF_ENDPOINT": hub.endpoint})
    ep = EndpointInfo("e0", "http://x", ("m",), "vllm", kv_events="tcp://x:1", tokenizer="hf://org/chat")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert shelf.tokenize(ep, "chat", body) is None  # not loaded yet: predicted, never fetched here
    assert not hub.requests()
    shelf.want(["hf://org/chat"])
    assert shelf.tokenize(ep, "chat", body)[-2:] == ids("assistant", "\n")
    # A repository without a tokenizer is remembered as failed, with the reason, and not asked again at once.
    shelf.want(["hf://org/none"])
    asked = len(hub.requests())
    shelf.want(["hf://org/none"])
    assert "org/none" in shelf.failed["hf://org/none"][1] and len(hub.requests()) == asked
    # The simulated engine's tokenizer is built in.
    sim = EndpointInfo("e1", "http://x", ("m",), "sim", kv_events="tcp://x:2")
    assert shelf.tokenize(sim, "chat", body)


def test_fetch_reads_a_revision(tmp_path, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    tok, cfg = tokenizer_files(tmp_path)
    hub.add_repo("org/chat", {"tokenizer.json": tok.read_bytes(), "tokenizer_config.json": cfg.read_bytes()},
                 revision="v2")
    assert fetch("org/chat", "v2", {"HF_ENDPOINT": hub.endpoint}).template is not None


def test_a_model_directory_with_its_template_in_chat_template_jinja(tmp_path):
    # transformers' save_pretrained writes the template to chat_template.jinja, not into
    # tokenizer_config.json (as `make vllm`'s model has it): without reading it, no chat tokenizes.
    tok, cfg = tokenizer_files(tmp_path, template=None)
    cfg.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert ChatTokenizer.from_dir(tmp_path).template is None
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    t = ChatTokenizer.from_dir(tmp_path)
    assert t.chat([{"role": "user", "content": "hi"}])[:2] == ids("<|im_start|>", "user")
    with pytest.raises(TokenizerUnavailable, match="no tokenizer.json"):
        ChatTokenizer.from_dir(tmp_path / "nothing")


def test_the_shelf_reads_a_local_model_directory(tmp_path):
    tokenizer_files(tmp_path)
    shelf = Tokenizers({}, load=lambda *a: pytest.fail("a local directory is not fetched"))
    shelf.want([str(tmp_path), "relative/dir"])  # a relative path is neither read nor fetched
    assert str(tmp_path) in shelf.loaded
