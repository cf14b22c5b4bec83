"""``python -m sim plan``: the plan search from the command line, and the Serve config
it writes for a MoE model the runtime can run."""

from __future__ import annotations

import pytest
import yaml

from actors.serving.config import ServeConfig
from models import write_tiny_model
from placement.model_specs import get_model
from placement.moe_plan import Hardware, Workload, search_plan
from placement.serve_plan import decode_context, model_spec_from_hf, serve_args
from sim.__main__ import main


def test_heterogeneous_plan_is_printed(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "dbrx",
                "--gpus",
                "H20,L40S",
                "--heterogeneous",
                "--avg-context",
                "650",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "of 8 x H20" in out.split("experts:")[0] and "x L40S" in out.split("experts:")[1]
    # A price that makes L40S dear moves the experts off it.
    assert (
        main(
            [
                "plan",
                "--model",
                "dbrx",
                "--gpus",
                "H20,L40S",
                "--heterogeneous",
                "--avg-context",
                "650",
                "--price",
                "L40S=5",
            ]
        )
        == 0
    )
    assert "L40S" not in capsys.readouterr().out


def test_writes_a_serve_config_the_schema_accepts(tmp_path, capsys):
    model_dir = write_tiny_model(tmp_path / "moe", kind="moe")
    out = tmp_path / "plan.yaml"
    argv = [
        "plan",
        "--model",
        str(model_dir),
        "--gpus",
        "CPU",
        "--gpus-per-node",
        "1",
        "--max-gpus",
        "5",
        "--tpot-slo",
        "0.5",
        "--avg-context",
        "64",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert text.startswith("# Written by python -m sim plan")
    config = yaml.safe_load(text)
    (app,) = config["applications"]
    assert app["import_path"] == "serve_app:build_app"
    serve = ServeConfig.model_validate(app["args"])
    (group,) = serve.groups
    engine = group.engine
    assert (engine.attention_workers, engine.expert_workers) == (1, 4)  # 5 GPUs, 4 experts
    assert engine.micro_batches in (3, 4)
    assert serve.model == str(model_dir.resolve())


def test_tensor_parallel_plans_are_not_written():
    model = get_model("mixtral-8x22b")
    plan = search_plan(model, [Hardware.named("A800")], None, Workload(650))
    assert plan.tp_a > 1 or plan.tp_e > 1
    with pytest.raises(ValueError, match="--gpus-per-node 1"):
        serve_args(plan, None, "mixtral")


def test_bad_arguments_say_what_to_fix(tmp_path, capsys):
    with pytest.raises(SystemExit, match="unknown GPU"):
        main(["plan", "--model", "dbrx", "--gpus", "XYZ", "--avg-context", "10"])
    with pytest.raises(SystemExit, match="--avg-context"):
        main(["plan", "--model", "dbrx"])
    with pytest.raises(SystemExit, match="dense"):
        main(["plan", "--model", "llama3-8b", "--avg-context", "10"])
    with pytest.raises(SystemExit, match="neither a known spec"):
        main(["plan", "--model", str(tmp_path / "nothing"), "--avg-context", "10"])
    with pytest.raises(SystemExit, match="GPU=NUMBER"):
        main(["plan", "--model", "dbrx", "--avg-context", "10", "--price", "H20"])


def test_model_spec_from_hf_and_decode_context():
    raw = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "vocab_size": 512,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "torch_dtype": "float32",
    }
    spec = model_spec_from_hf(raw, "tiny")
    assert (spec.head_dim, spec.num_experts, spec.top_k, spec.dtype_bytes) == (16, 4, 2, 4)
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        model_spec_from_hf({k: v for k, v in raw.items() if k != "vocab_size"}, "x")
    assert decode_context([(100, 10), (300, 30)]) == pytest.approx((105 + 315) / 2)
    with pytest.raises(ValueError):
        decode_context([])


def _write_trace(path, rows):
    """A Mooncake-format trace: (seconds, input tokens, output tokens) per request."""
    import json

    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": 1000 * t, "input_length": n, "output_length": o, "hash_ids": [i]}
            )
            + "\n"
            for i, (t, n, o) in enumerate(rows)
        )
    )
    return path


def test_dense_plan_from_a_trace_writes_a_group_and_the_replay_verdict(tmp_path, capsys):
    trace = _write_trace(tmp_path / "t.jsonl", [(i * 0.1, 400 + 7 * i, 64) for i in range(200)])
    out = tmp_path / "dense.yaml"
    argv = ["plan", "--model", "llama3-8b", "--gpus", "A100", "--trace", str(trace)]
    assert main([*argv, "--ttft-slo", "5", "--tpot-slo", "0.1", "--out", str(out)]) == 0
    text = out.read_text()
    comments = [ln for ln in text.splitlines() if ln.startswith("# ")]
    verdict = [ln for ln in comments if "simulated replay of 200 requests" in ln]
    assert len(verdict) == 1 and "the SLOs hold" in verdict[0]
    assert verdict[0][2:] in capsys.readouterr().out
    (app,) = yaml.safe_load(text)["applications"]
    serve = ServeConfig.model_validate(app["args"])
    (group,) = serve.groups
    assert group.name == "dense" and group.num_replicas >= 1
    # More GPUs than --max-gpus allows is refused with the fix.
    with pytest.raises(SystemExit, match="--max-gpus"):
        main([*argv, "--ttft-slo", "5", "--tpot-slo", "0.1", "--max-gpus", "0"])
    with pytest.raises(SystemExit, match="needs --trace"):
        main(["plan", "--model", "llama3-8b", "--gpus", "A100"])
    with pytest.raises(SystemExit, match="--dense-modes"):
        main([*argv, "--dense-modes", "both"])
    # Only P/D allowed: the group is disaggregated.
    assert main([*argv, "--ttft-slo", "5", "--dense-modes", "pd", "--out", str(out)]) == 0
    (app,) = yaml.safe_load(out.read_text())["applications"]
    (group,) = ServeConfig.model_validate(app["args"]).groups
    assert group.disaggregated and group.conductor is not None


def test_moe_plan_with_a_trace_replays_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MERIDIAN_CACHE", str(tmp_path / "cache"))
    trace = _write_trace(tmp_path / "t.jsonl", [(2.0 * i, 20 + i, 8) for i in range(10)])
    out = tmp_path / "moe.yaml"
    argv = ["plan", "--model", "tiny-moe", "--gpus", "CPU", "--gpus-per-node", "1"]
    argv += ["--max-gpus", "5", "--tpot-slo", "0.02", "--trace", str(trace), "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "# simulated replay of 10 requests" in text
    (app,) = yaml.safe_load(text)["applications"]
    serve = ServeConfig.model_validate(app["args"])
    assert serve.model == str((tmp_path / "cache" / "tiny-moe-v1").resolve())
    assert serve.model_name == "meridian-tiny-moe"
    (group,) = serve.groups
    assert (group.engine.attention_workers, group.engine.expert_workers) == (1, 4)
