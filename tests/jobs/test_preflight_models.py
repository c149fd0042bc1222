"""The checks that need no weights: device, config, meta-device skeleton, hub ids offline."""

from __future__ import annotations

import http.server
import json
import logging
import shutil
import threading
import time

import huggingface_hub.constants
import pytest
import torch
import transformers
from conftest import FAMILY_NAMES, TINY_CONFIGS, make_tiny_model

from lmcompress.compressor.model import checkpoint
from lmcompress.compressor.model.checkpoint import (
    DEFAULT_CHECKPOINT,
    check_checkpoint,
    max_positions,
    model_config,
)
from lmcompress.compressor.model.loading import check_device, load_model, model_skeleton
from lmcompress.errors import ConfigError, ModelLoadError
from tests.compressor.model.test_loading import _write_tiny_llama_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _one_line(err: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _no_weights(monkeypatch) -> None:
    """Any weight read fails the test."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


# --- check_device ------------------------------------------------------------------------------


def test_cpu_is_accepted():
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("device", ["gpu7", "cuda:x", ""])
def test_unknown_device_string(device):
    with pytest.raises(ConfigError) as err:
        check_device(device)
    _one_line(err, "unknown device", repr(device))


def test_meta_is_not_a_device_to_compute_on():
    with pytest.raises(ConfigError) as err:
        check_device("meta")
    _one_line(err, "device meta", "use cpu, cuda, cuda:N or mps")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
def test_unavailable_backend(monkeypatch, device):
    backend = torch.cuda if device.startswith("cuda") else torch.mps
    monkeypatch.setattr(backend, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        check_device(device)
    name = device.split(":")[0].upper()
    _one_line(err, f"device {device}:", f"no {name}", torch.__version__, "no GPU is visible")


def test_cuda_index_past_the_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == torch.device("cuda:1")
    assert check_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError) as err:
        check_device("cuda:2")
    _one_line(err, "device cuda:2", "only 2 cuda device(s) visible")


def test_load_model_checks_the_device_before_any_weight(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _no_weights(monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_model(tiny_checkpoint, device="cuda")
    _one_line(err, "device cuda", "no CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_devices():
    count = torch.cuda.device_count()
    assert check_device(f"cuda:{count - 1}") == torch.device(f"cuda:{count - 1}")
    with pytest.raises(ConfigError, match=f"only {count} cuda"):
        check_device(f"cuda:{count}")


# --- model_config and max_positions ------------------------------------------------------------


def test_config_of_a_directory_reads_no_weight(tiny_checkpoint, monkeypatch):
    _no_weights(monkeypatch)
    (tiny_checkpoint / "model.safetensors").write_bytes(b"garbage: never read")
    config = model_config(tiny_checkpoint)
    expected = make_tiny_model("llama").config
    assert type(config) is transformers.LlamaConfig
    assert config.architectures == ["LlamaForCausalLM"]  # save_pretrained records it
    assert {**config.to_diff_dict(), "architectures": None} == {
        **expected.to_diff_dict(),
        "architectures": None,
    }


def test_config_of_a_gguf_file(tmp_path):
    _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    config = model_config(tmp_path / "tiny.gguf")
    expected = make_tiny_model("llama").config
    assert config.model_type == "llama"
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        assert getattr(config, name) == getattr(expected, name), name
    assert max_positions(config) == 128


def test_config_of_an_alias_prefers_the_cache(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path / "cache"))
    _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(checkpoint, "alias_gguf", lambda _name: tmp_path / "tiny.gguf")
    before = model_config(DEFAULT_CHECKPOINT)  # no cache yet: the GGUF's metadata
    assert before.num_hidden_layers == 2
    cached = tmp_path / "cache" / DEFAULT_CHECKPOINT
    shutil.copytree(tiny_checkpoint, cached)
    config = json.loads((cached / "config.json").read_text())
    (cached / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    (tmp_path / "tiny.gguf").unlink()  # the cache alone answers now
    assert model_config(DEFAULT_CHECKPOINT).num_hidden_layers == 5


def test_config_of_an_unsupported_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError) as err:
        model_config(path)
    _one_line(err, str(path), "unreadable config")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_max_positions_of_every_family(family):
    config = TINY_CONFIGS[family]()
    assert max_positions(config) == 128


def test_max_positions_unknown():
    assert max_positions(transformers.PretrainedConfig()) is None


# --- model_skeleton ----------------------------------------------------------------------------


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Module name -> (class name, weight shape for linears) for every module."""
    return {
        name: (type(m).__name__, tuple(getattr(m, "weight", torch.empty(0)).shape))
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_skeleton_matches_the_model(family):
    model = make_tiny_model(family)
    skeleton = model_skeleton(model.config)
    assert _layout(skeleton) == _layout(model)
    assert {n: p.shape for n, p in skeleton.named_parameters()} == {
        n: p.shape for n, p in model.named_parameters()
    }
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert not skeleton.training


def test_skeleton_of_a_checkpoint_matches_the_loaded_model(tiny_checkpoint):
    loaded, _ = load_model(tiny_checkpoint)
    skeleton = model_skeleton(model_config(tiny_checkpoint), dtype="bfloat16")
    assert _layout(skeleton) == _layout(loaded)
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight  # tied, as loaded
    assert {p.dtype for p in skeleton.parameters()} == {torch.bfloat16}


# --- hub ids -----------------------------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty local hub cache, online, with the hub at ``hub.endpoint`` (a closed port
    unless a test serves one); returns a namespace to set the endpoint on."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def point_at(endpoint: str) -> None:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)

    point_at("http://127.0.0.1:9")  # the discard port: connection refused at once
    return point_at


def _fill_hub_cache(tmp_path, repo_id: str, config: dict) -> None:
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text(json.dumps(config))


@pytest.mark.usefixtures("hub")
@pytest.mark.parametrize("offline", [False, True])
def test_unreachable_hub_is_one_quiet_line_at_once(monkeypatch, caplog, capfd, offline):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    start = time.monotonic()
    with caplog.at_level(logging.INFO), pytest.raises(ModelLoadError) as err:
        check_checkpoint("some-org/some-model")
    assert time.monotonic() - start < 2  # huggingface_hub's own retries take ~25 s
    reason = "HF_HUB_OFFLINE is set" if offline else "not in the local hub cache"
    _one_line(err, "some-org/some-model is not a local path", "(offline?)", reason)
    noise = [r for r in caplog.records if r.name.startswith(("huggingface_hub", "transformers"))]
    assert noise == []
    assert capfd.readouterr().err == ""  # huggingface_hub also has a handler of its own


@pytest.mark.usefixtures("hub")
@pytest.mark.parametrize("offline", [False, True])
def test_unreachable_hub_falls_back_to_the_hub_cache(tmp_path, monkeypatch, offline):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    _fill_hub_cache(tmp_path, "some-org/cached", make_tiny_model("gpt2").config.to_dict())
    check_checkpoint("some-org/cached")
    config = model_config("some-org/cached")
    assert type(config) is transformers.GPT2Config and max_positions(config) == 128


@pytest.mark.usefixtures("hub")
def test_hub_config_of_an_unsupported_architecture(tmp_path):
    _fill_hub_cache(tmp_path, "some-org/bert", {"model_type": "bert"})
    with pytest.raises(ModelLoadError) as err:
        check_checkpoint("some-org/bert")
    _one_line(err, "unsupported architecture 'bert'")


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Serves ``config.json`` of one repo; every other repo does not exist."""

    config = json.dumps(TINY_CONFIGS["qwen2"]().to_dict()).encode()
    requests: list[str] = []

    def do_HEAD(self):  # noqa: N802
        self._answer(body=False)

    def do_GET(self):  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        self.requests.append(f"{self.command} {self.path}")
        if self.path != "/org/served/resolve/main/config.json":
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("ETag", '"cafe"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Content-Length", str(len(self.config)))
        self.end_headers()
        if body:
            self.wfile.write(self.config)

    def log_message(self, *_args):
        pass


@pytest.fixture
def fake_hub(hub):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub(f"http://127.0.0.1:{server.server_address[1]}")
    _FakeHub.requests = []
    yield _FakeHub.requests
    server.shutdown()
    server.server_close()


def test_reachable_hub_fetches_config_json_only(fake_hub, monkeypatch):
    _no_weights(monkeypatch)
    check_checkpoint("org/served")
    config = model_config("org/served")
    assert type(config) is transformers.Qwen2Config and config.hidden_size == 32
    assert {r.split()[1] for r in fake_hub} == {"/org/served/resolve/main/config.json"}


def test_hub_answers_no_such_model(fake_hub):
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as err:
        check_checkpoint("org/missing")
    assert time.monotonic() - start < 2
    _one_line(err, "org/missing: no such model on the Hugging Face hub", "hf auth login")
    assert len(fake_hub) == 1  # one request, no retries
