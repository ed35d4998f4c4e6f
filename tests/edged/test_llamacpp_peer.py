"""``edged bench --baseline llamacpp`` without the real peer: a missing build is a clear error,
and the client and the report run end to end against stand-in binaries that speak llama-server's
streaming protocol and print llama-bench's JSON (the real ones take 15 minutes to build)."""

from __future__ import annotations

import io
import json
import sys
import textwrap

import pytest

from cloudd.trace import bundled_trace
from edged.__main__ import main
from edged.llamacpp_peer import LlamaServer, PeerMissing, _read_stream, peer_binary

FAKE_SERVER = textwrap.dedent('''\
    #!{python}
    """Speaks llama-server's health check and streamed chat completions (3 tokens of a plan)."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    assert sys.argv[sys.argv.index("--host") + 1] == "127.0.0.1"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] and body["temperature"] == 0
            pieces = ['{{"steps": ', '[]', '}}'] if "json_schema" in body else ["a", "b", "c"]
            pieces = pieces[: body["max_tokens"]]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                event = {{"choices": [{{"delta": {{"content": piece}},
                                       "finish_reason": "stop" if last else None}}]}}
                if last:
                    event["timings"] = {{"predicted_n": len(pieces), "predicted_per_second": 50.0}}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n")
            self.wfile.write(b"data: [DONE]\\n\\n")

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')
FAKE_BENCH = textwrap.dedent('''\
    #!{python}
    import json
    print(json.dumps([{{"n_prompt": 0, "n_gen": 128, "avg_ts": 100.0}}]))
''')


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    bin_dir = tmp_path / "llama.cpp-build" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("llama-server", FAKE_SERVER), ("llama-bench", FAKE_BENCH)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable))
        path.chmod(0o755)
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    return tmp_path


def test_a_missing_peer_names_its_setup(tmp_path, monkeypatch, default_model_path, capsys):
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    with pytest.raises(PeerMissing, match="setup.sh"):
        peer_binary("llama-server")
    args = ["bench", "--model", str(default_model_path), "--backend", "torch", "--quant", "none",
            "--baseline", "llamacpp", "--trace", str(bundled_trace()), "--json"]
    assert main(args) == 2
    out = capsys.readouterr()
    assert out.out == "" and "setup.sh" in out.err


def test_the_baseline_needs_a_gguf(fake_peer, tmp_path, capsys):
    folder = tmp_path / "hf-model"
    folder.mkdir()
    assert main(["bench", "--model", str(folder), "--baseline", "llamacpp", "--json"]) == 2
    assert "not a GGUF" in capsys.readouterr().err


def test_the_stream_reader_times_content_chunks():
    events = [{"choices": [{"delta": {"role": "assistant"}}]},
              {"choices": [{"delta": {"content": "{"}}]},
              {"choices": [{"delta": {"content": "}"}, "finish_reason": "length"}], "timings": {"predicted_n": 2}}]
    raw = io.BytesIO(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n")
    stamps, parts, timings, finish = _read_stream(raw)
    assert len(stamps) == 2 and stamps[0] <= stamps[1]
    assert parts == ["{", "}"] and timings == {"predicted_n": 2} and finish == "length"


def test_the_client_streams_from_a_server_on_loopback(fake_peer, default_model_path):
    with LlamaServer(default_model_path, threads=1) as server:
        plan = server.chat([{"role": "user", "content": "plan"}], 16, json_schema={"type": "object"})
        assert (plan.text, plan.tokens, plan.decode_tok_s, plan.finish_reason) == ('{"steps": []}', 3, 50.0, "stop")
        assert 0 < plan.ttft_s <= plan.total_s
    assert server.process.poll() is not None  # stopped on exit


def test_bench_reports_the_peer_beside_edged(fake_peer, default_model_path, capsys):
    args = ["bench", "--model", str(default_model_path), "--backend", "torch", "--quant", "none",
            "--requests", "1", "--decode-tokens", "2", "--plan-tokens", "8", "--trace", str(bundled_trace()),
            "--baseline", "llamacpp", "--no-progress", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    peer = report["runs"]["llamacpp"]
    assert {"ttft_s", "decode_tok_s", "plan_s"} <= set(peer) and set(report["runs"]["torch-none"]) >= set(peer) - {
        "bench_tg128_tok_s"}
    assert peer["bench_tg128_tok_s"] == 100.0 and peer["complete_plan_rate"] == 1.0
    ours = report["runs"]["torch-none"]
    ratios = report["ratios"]
    assert ratios["torch-none_plan_s_over_llamacpp"] == pytest.approx(ours["plan_s"] / peer["plan_s"])
    assert ratios["torch-none_decode_over_llama_bench_tg128"] == pytest.approx(ours["decode_tok_s"] / 100.0)
