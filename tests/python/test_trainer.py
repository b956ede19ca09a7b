"""keel.Trainer: the CLI's trainer from Python.

- the reference article's training example (its field names, paths pointing at a tiny GLM-4 built
  with transformers) trains and returns the summary;
- the Python API and `keel train` write identical metrics.jsonl for the same recipe;
- callbacks see every logged step, evaluation and save; an exception in one stops the run and
  reaches the caller; Ctrl-C stops at a step boundary with a checkpoint and raises
  KeyboardInterrupt, and resuming gives the uninterrupted run's numbers;
- other Python threads run while keel trains (the GIL is released);
- keel.plan, keel.prepare and keel.generate give what the CLI gives.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
import transformers

import keel
import keel._command
from conftest import (SMALL_MODEL, metrics_lines, run_cli, without_timing, write_counting_data, write_recipe)


@pytest.fixture
def glm_model(tmp_path):
    torch.manual_seed(0)
    config = transformers.GlmConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=128, partial_rotary_factor=0.5, pad_token_id=0,
                                    eos_token_id=1, bos_token_id=1)
    path = tmp_path / "glm-4-9b"
    transformers.GlmForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def small_config(tmp_path, **overrides):
    data = write_counting_data(tmp_path / "train.jsonl", 120, seed=1)
    keys = dict(data_path=data, dtype="fp32", max_seq_len=16, batch_size=4, gradient_accumulation_steps=2,
                learning_rate=3e-3, warmup_steps=2, max_steps=8, seed=5, log_interval=2,
                output_dir=str(tmp_path / "out"), model_config=dict(SMALL_MODEL))
    keys.update(overrides)
    return keel.TrainingConfig(**keys)


def test_the_articles_example(tmp_path, glm_model):
    data = write_counting_data(tmp_path / "train_data.jsonl", 200, seed=2)
    config = keel.TrainingConfig(
        # model
        model_name=glm_model, dtype="bf16",
        # data
        data_path=data, max_seq_len=32, preprocess_on_npu=True,
        # training
        batch_size=4, gradient_accumulation_steps=4, learning_rate=2e-5, weight_decay=0.01, max_steps=4,
        warmup_steps=2,
        # parallelism (the article's 4 cards: dp_degree=4 under `keel launch -n 4`; one process here)
        dp_degree=1,
        # optimisations
        use_flash_attention=True, use_gradient_checkpointing=False, hccl_topology="hccs_full_mesh",
        memory_pool_size=56,
        # checkpoints
        checkpoint_dir=str(tmp_path / "checkpoints"), save_interval=2, async_save=True,
        output_dir=str(tmp_path / "output"))
    trainer = keel.Trainer(config)
    summary = trainer.train()
    assert summary["steps"] == 4 and summary["interrupted"] is False
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    with open(tmp_path / "output" / "summary.json") as f:
        assert json.load(f)["steps"] == 4
    assert os.path.exists(tmp_path / "output" / "final" / "config.json")
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "step-00000004"


def test_same_metrics_as_the_cli(tmp_path):
    config = small_config(tmp_path, shuffle=True, eval_data_path=write_counting_data(tmp_path / "eval.jsonl", 20, 9),
                          eval_interval=4, output_dir=str(tmp_path / "python"))
    keel.Trainer(config).train()
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(config.to_toml().replace(str(tmp_path / "python"), str(tmp_path / "cli")))
    r = run_cli("train", recipe)
    assert r.returncode == 0, r.stderr
    python, cli = metrics_lines(tmp_path / "python"), metrics_lines(tmp_path / "cli")
    assert len(python) == 8 and without_timing(python) == without_timing(cli)


def test_callbacks(tmp_path):
    seen = {"log": [], "evaluate": [], "save": []}

    class Recorder:
        def on_log(self, step, metrics):
            seen["log"].append((step, metrics))

        def on_evaluate(self, step, metrics):
            seen["evaluate"].append((step, metrics))

        def on_save(self, step, directory):
            seen["save"].append((step, directory))

    config = small_config(tmp_path, eval_data_path=write_counting_data(tmp_path / "eval.jsonl", 20, 9),
                          eval_interval=4, checkpoint_dir=str(tmp_path / "ckpt"), save_interval=3)
    keel.Trainer(config, callbacks=[Recorder()]).train()
    logged = metrics_lines(tmp_path / "out")
    assert [s for s, _ in seen["log"]] == [2, 4, 6, 8]
    for step, metrics in seen["log"]:
        line = logged[step - 1]
        assert metrics["loss"] == pytest.approx(line["loss"], rel=1e-8) and metrics["tokens"] == line["tokens"]
    assert [s for s, _ in seen["evaluate"]] == [4, 8]
    assert seen["evaluate"][0][1]["eval_loss"] == pytest.approx(logged[3]["eval_loss"], rel=1e-8)
    assert seen["save"] == [(3, str(tmp_path / "ckpt")), (6, str(tmp_path / "ckpt")), (8, str(tmp_path / "ckpt"))]


def test_evaluate_before_and_after_training(tmp_path):
    config = small_config(tmp_path, eval_data_path=write_counting_data(tmp_path / "eval.jsonl", 20, 9),
                          eval_interval=4)
    trainer = keel.Trainer(config)
    before = trainer.evaluate()
    summary = trainer.train()
    after = trainer.evaluate()
    # The trained model (output_dir/final) gives what the run's last evaluation logged.
    assert after["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)
    assert after["eval_loss"] < before["eval_loss"] and after["eval_target_tokens"] > 0
    with pytest.raises(keel.Error, match="eval_data_path"):
        keel.Trainer(small_config(tmp_path, output_dir=str(tmp_path / "other"))).evaluate()


def test_evaluate_a_data_parallel_config_in_one_process(tmp_path):
    """evaluate() runs in one process on the whole model, whatever data-parallel sharding the config
    trains with (bf16 ZeRO-1/2 shard the fp32 masters, ZeRO-3 the weights): the same figures."""
    eval_data = write_counting_data(tmp_path / "eval.jsonl", 20, 9)
    expected = keel.Trainer(small_config(tmp_path, eval_data_path=eval_data, dtype="bf16")).evaluate()
    for zero in (1, 2, 3):
        config = small_config(tmp_path, eval_data_path=eval_data, dtype="bf16", dp_degree=2, zero_stage=zero)
        assert keel.Trainer(config).evaluate() == expected, "ZeRO-%d" % zero


def test_an_exception_in_a_callback_stops_the_run(tmp_path):
    def on_log(step, metrics):
        if step == 4:
            raise ValueError("the user's logger failed")

    config = small_config(tmp_path)
    with pytest.raises(ValueError, match="the user's logger failed"):
        keel.Trainer(config, on_log=on_log).train()
    assert len(metrics_lines(tmp_path / "out")) == 4
    # The run's directory lock went with it: the same config trains again.
    assert keel.Trainer(config).train()["steps"] == 8


def test_ctrl_c_stops_at_a_step_and_resume_matches(tmp_path):
    full = small_config(tmp_path, output_dir=str(tmp_path / "full"))
    keel.Trainer(full).train()

    def interrupt(step, metrics):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)  # as the user's Ctrl-C: keel stops after this step

    config = small_config(tmp_path, checkpoint_dir=str(tmp_path / "ckpt"), log_interval=1)
    trainer = keel.Trainer(config, on_log=interrupt)
    with pytest.raises(KeyboardInterrupt, match="resume"):
        trainer.train()
    assert trainer.summary["interrupted"] is True
    steps = [l["step"] for l in metrics_lines(tmp_path / "out")]
    assert steps == [1, 2, 3, 4, 5] or steps == [1, 2, 3, 4]  # the step the signal arrived in ends
    assert os.path.exists(tmp_path / "ckpt" / "latest")
    summary = keel.Trainer(config).train(resume="auto")
    assert summary["interrupted"] is False
    assert without_timing(metrics_lines(tmp_path / "out")) == without_timing(metrics_lines(tmp_path / "full"))


def test_other_threads_run_while_keel_trains(tmp_path):
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.001)

    seen_at_log = []
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        keel.Trainer(small_config(tmp_path, max_steps=20, log_interval=5),
                     on_log=lambda step, m: seen_at_log.append(len(ticks))).train()
    finally:
        stop.set()
        thread.join()
    # The ticker advanced between the first and the last logged step, while keel computed the steps
    # between them (a native call holding the GIL would have stopped it).
    assert len(seen_at_log) == 4 and seen_at_log[-1] > seen_at_log[0], seen_at_log


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (Open MPI: scripts/install-deps.sh)")
def test_data_parallel_under_mpirun(tmp_path):
    """`mpirun -np 2 python train.py` trains as `mpirun -np 2 keel train recipe.toml` does."""
    config = small_config(tmp_path, dp_degree=2, batch_size=2, output_dir=str(tmp_path / "python"))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(config.to_toml().replace(str(tmp_path / "python"), str(tmp_path / "cli")))
    script = tmp_path / "train.py"
    # Each rank writes what train() returned to a file of its own: two ranks printing to one mpirun
    # stdout can interleave their lines ("stepssteps 8\n 8\n" was seen under CI's load).
    script.write_text("import os, sys, keel\nconfig = keel.TrainingConfig.from_toml(sys.argv[1])\n"
                      "steps = keel.Trainer(config).train()['steps']\n"
                      "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
                      "open(os.path.join(sys.argv[2], 'returned.' + rank), 'w').write(str(steps))\n")
    (tmp_path / "python.toml").write_text(config.to_toml())
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS=1"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    python = subprocess.run(mpirun + ["-x", "PYTHONPATH", sys.executable, str(script), str(tmp_path / "python.toml"),
                                      str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert python.returncode == 0, python.stdout[-2000:] + python.stderr[-2000:]
    # Both ranks return the summary.
    assert [(tmp_path / f"returned.{rank}").read_text() for rank in (0, 1)] == ["8", "8"]
    cli = subprocess.run(mpirun + [keel._command.keel_binary(), "train", str(recipe)], capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert without_timing(metrics_lines(tmp_path / "python")) == without_timing(metrics_lines(tmp_path / "cli"))


def test_plan_prepare_generate_as_the_cli(tmp_path, chat_setup):
    config = small_config(tmp_path)
    plan = keel.plan(config, dp=2, zero_stage=1, device_memory="1GB")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(config.to_toml())
    cli = run_cli("plan", recipe, "--dp", 2, "--zero", 1, "--device-memory", "1GB", "--json")
    assert cli.returncode == 0, cli.stderr
    assert plan == json.loads(cli.stdout)
    # The report the CLI prints, after its first line (which names the recipe's source).
    assert keel.plan(config, text=True).split("\n", 1)[1] == run_cli("plan", recipe).stdout.split("\n", 1)[1]

    report = keel.prepare(chat_setup["data"], tmp_path / "prepared", tokenizer=chat_setup["tokenizer"],
                          max_seq_len=64, chat_template="chatml")
    assert report["records"] == 200 and report["bad_records"] == 0
    assert json.load(open(tmp_path / "prepared" / "report.json")) == report
    with pytest.raises(keel.Error, match="missing.jsonl"):
        keel.prepare(tmp_path / "missing.jsonl", tmp_path / "p2", max_seq_len=64, vocab_size=32)

    text = keel.generate(chat_setup["model"], "the model", max_new_tokens=8)
    cli = run_cli("generate", "--model", chat_setup["model"], "--prompt", "the model", "--max-new-tokens", 8)
    assert cli.returncode == 0 and text == cli.stdout
    with pytest.raises(keel.Error, match="config.json"):
        keel.generate(str(tmp_path / "nowhere"), "x")


def test_rank_table_as_the_article_spells_it(tmp_path):
    """python -m keel.rank_table --npu_count 4 --topology hccs_full_mesh: `keel rank-table`'s table."""
    python = subprocess.run([sys.executable, "-m", "keel.rank_table", "--npu_count", "4", "--topology",
                             "hccs_full_mesh", "--out", str(tmp_path / "python.json")], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert python.returncode == 0, python.stderr
    cli = run_cli("rank-table", "--npu-count", 4, "--topology", "hccs_full_mesh", "--out", tmp_path / "cli.json")
    assert cli.returncode == 0, cli.stderr
    a, b = (json.load(open(tmp_path / n)) for n in ("python.json", "cli.json"))
    assert a == b and len(a["server_list"][0]["device"]) == 4


def test_preference_stage_through_the_trainer(tmp_path):
    """stage = "dpo" from Python: on_log gets TRL's metrics as metrics.jsonl has them; step 1 is ln 2."""
    import math
    import random
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    from dpo_reference import make_pairs, make_tokenizer
    vocab = make_tokenizer(str(tmp_path / "tokenizer"), random.Random(3))
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in make_pairs(random.Random(4), "strings", 16)))
    config = keel.TrainingConfig(data_path=str(data), tokenizer=str(tmp_path / "tokenizer"), stage="dpo",
                                 dtype="fp32", max_seq_len=40, batch_size=2, max_steps=4, learning_rate=3e-3,
                                 seed=5, log_interval=1, output_dir=str(tmp_path / "out"),
                                 model_config=dict(SMALL_MODEL, vocab_size=vocab))
    logs = []

    class Recorder:
        def on_log(self, step, metrics):
            logs.append(metrics)

    keel.Trainer(config, callbacks=[Recorder()]).train()
    logged = metrics_lines(tmp_path / "out")
    assert len(logs) == len(logged) == 4
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and logs[0]["rewards/margins"] == 0
    for metrics, line in zip(logs, logged):
        for key in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "logits/rejected"):
            assert metrics[key] == pytest.approx(line[key], rel=1e-8), key
