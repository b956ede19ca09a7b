"""keel.TrainingConfig: every recipe key as a keyword, validated by the recipe's own parser.

- its keys are exactly the keys `keel train --print-recipe` prints, with their types and defaults;
  the reference article's 19 names are all accepted;
- every mistake is a keel.Error with the CLI's message for the same mistake in a recipe file;
- to/from TOML: a recipe file read by TrainingConfig resolves to what `keel train --print-recipe`
  prints for it, and the TOML of a config reads back as the same config.
"""
import re
import tomllib

import pytest

import keel
from conftest import run_cli, write_recipe

MINIMAL = {"model_name": "m", "data_path": "d.jsonl", "max_steps": 3}

# The reference article's TrainingConfig (its 19 names; paths and sizes of this machine).
ARTICLE = dict(model_name="models/glm-4-9b", dtype="bf16", data_path="/shared/train_data.jsonl", max_seq_len=8192,
               preprocess_on_npu=True, batch_size=4, gradient_accumulation_steps=4, learning_rate=2e-5,
               weight_decay=0.01, max_steps=10000, warmup_steps=200, dp_degree=4, use_flash_attention=True,
               use_gradient_checkpointing=False, hccl_topology="hccs_full_mesh", memory_pool_size=56,
               checkpoint_dir="/shared/checkpoints", save_interval=2000, async_save=True)


def test_keys_are_the_recipes(tmp_path):
    recipe = write_recipe(tmp_path / "r.toml", MINIMAL)
    r = run_cli("train", recipe, "--print-recipe")
    assert r.returncode == 0, r.stderr
    printed = tomllib.loads(r.stdout)
    keys = keel.TrainingConfig.keys()
    model_config = keys.pop("model_config")
    assert set(keys) == set(printed)
    defaults = tomllib.loads(run_cli("train", write_recipe(tmp_path / "s.toml", {"data_path": "d", "max_steps": 1},
                                                           {"vocab_size": 8, "hidden_size": 8,
                                                            "intermediate_size": 8, "num_layers": 1,
                                                            "num_heads": 1}), "--print-recipe").stdout)
    assert set(model_config) == set(defaults["model_config"])
    for key, value in keys.items():
        assert type(value) is type(printed[key]), key
    sig = keel.TrainingConfig.__init__.__signature__
    assert sig.parameters["learning_rate"].annotation is float and sig.parameters["batch_size"].default == 1


def test_the_articles_config():
    config = keel.TrainingConfig(**ARTICLE)
    assert len(ARTICLE) == 19
    assert config.topology == "hccs_full_mesh" and config.hccl_topology == "hccs_full_mesh"
    assert config.dp_degree == 4 and config.memory_pool_size == 56.0 and config.async_save is True


# (keyword arguments, the same mistake as recipe lines)
MISTAKES = [
    (dict(batch_size=0), {"batch_size": 0}),
    (dict(learning_rte=1e-3), {"learning_rte": 1e-3}),
    (dict(dtype="fp8"), {"dtype": "fp8"}),
    (dict(batch_size="four"), {"batch_size": "four"}),
    (dict(lr_scheduler="step"), {"lr_scheduler": "step"}),
    (dict(zero_stage=4), {"zero_stage": 4}),
    (dict(report_to="wandb"), {"report_to": "wandb"}),
    (dict(lora_rank=16), {"lora_rank": 16}),
    (dict(quantization_bit=4), {"quantization_bit": 4}),
    (dict(eval_interval=5), {"eval_interval": 5}),
    (dict(max_grad_norm=-1.0), {"max_grad_norm": -1.0}),
    (dict(lora_target=["q_proj", 3]), {"lora_target": ["q_proj", 3]}),
    (dict(pref_beta=0.3), {"pref_beta": 0.3}),  # a preference key under stage = "sft"
    (dict(stage="ppo"), {"stage": "ppo"}),
]


def message(text):
    """The message without its place ("r.toml:4: ", "TrainingConfig(batch_size=0): ")."""
    text = text.strip()
    text = text[len("error: "):] if text.startswith("error: ") else text
    return re.sub(r"^(TrainingConfig\(.*?\)|TrainingConfig|[^ :]+(:\d+)?): ", "", text, count=1)


@pytest.mark.parametrize("kwargs,lines", MISTAKES, ids=[next(iter(k)) for k, _ in MISTAKES])
def test_errors_are_the_clis(tmp_path, kwargs, lines):
    recipe = write_recipe(tmp_path / "r.toml", {**MINIMAL, **lines})
    cli = run_cli("train", recipe, "--print-recipe")
    assert cli.returncode == 2, cli.stdout
    with pytest.raises(keel.Error) as python:
        keel.TrainingConfig(**MINIMAL, **kwargs)
    key = next(iter(kwargs))
    assert str(python.value).startswith("TrainingConfig(%s=" % key), str(python.value)
    assert message(str(python.value)) == message(cli.stderr.splitlines()[-1])


def test_required_keys_and_model_config():
    with pytest.raises(keel.Error, match="key 'data_path' is required"):
        keel.TrainingConfig(model_name="m", max_steps=1)
    with pytest.raises(keel.Error, match=r"did you mean 'family'"):
        keel.TrainingConfig(data_path="d", max_steps=1, model_config={"famly": "llama"})
    config = keel.TrainingConfig(data_path="d", max_steps=1,
                                 model_config=dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1,
                                                   num_heads=2))
    assert config.model_config["family"] == "llama" and config.model_config["rope_theta"] == 10000.0


def test_unknown_keywords_are_named_together():
    """Several unknown keywords: one keel.Error naming each, in the order given, with suggestions."""
    with pytest.raises(keel.Error) as e:
        keel.TrainingConfig(**MINIMAL, neftune_noise_alpha=5, galore_rank=16, learning_rte=1e-3,
                            model_config={"famly": "llama"})
    text = str(e.value)
    assert text.startswith("4 unknown keys:\n"), text
    places = [text.index("TrainingConfig(%s=" % key)
              for key in ("neftune_noise_alpha", "galore_rank", "learning_rte", "model_config")]
    assert places == sorted(places), text
    assert "unknown key 'learning_rte' (did you mean 'learning_rate'?)" in text
    assert "unknown key 'famly' in [model_config] (did you mean 'family'?)" in text


def test_no_training_length_needed_until_training():
    """max_steps / num_epochs is asked for by Trainer.train, not by the config (keel.plan needs neither)."""
    config = keel.TrainingConfig(model_name="m", data_path="d.jsonl")
    assert config.max_steps == 0 and config.num_epochs == 0
    with pytest.raises(keel.Error, match="^TrainingConfig: set 'max_steps' or 'num_epochs'$"):
        keel.Trainer(config).train()


def test_attributes_are_checked_on_assignment():
    config = keel.TrainingConfig(**MINIMAL)
    config.max_steps = 7
    assert config.max_steps == 7
    with pytest.raises(keel.Error, match=r"did you mean 'max_steps'"):
        config.max_step = 3
    with pytest.raises(keel.Error, match="must be positive"):
        config.batch_size = 0
    assert config.batch_size == 1  # a refused value leaves the config as it was


def test_toml_round_trips(tmp_path):
    (tmp_path / "data").mkdir()
    recipe = write_recipe(tmp_path / "r.toml", {"model_name": "models/m", "data_path": "data/train.jsonl",
                                                "max_steps": 9, "lora_target": ["q_proj", "v_proj"],
                                                "finetuning_type": "lora", "report_to": ["tensorboard"]})
    config = keel.TrainingConfig.from_toml(str(recipe))
    cli = run_cli("train", recipe, "--print-recipe", cwd="/")
    assert cli.returncode == 0, cli.stderr
    assert config.to_toml() == cli.stdout  # paths relative to the recipe's directory, as the CLI reads it
    assert config.data_path == str(tmp_path / "data" / "train.jsonl")
    assert keel.TrainingConfig.from_toml(config.to_toml()) == config
    assert keel.TrainingConfig(**config.to_dict()) == config


def test_preference_keys():
    config = keel.TrainingConfig(**MINIMAL, stage="dpo", pref_loss="simpo", pref_beta=2.0, simpo_gamma=0.8)
    assert (config.stage, config.pref_loss, config.pref_beta, config.simpo_gamma) == ("dpo", "simpo", 2.0, 0.8)
    with pytest.raises(keel.Error, match="ORPO"):
        keel.TrainingConfig(**MINIMAL, stage="dpo", pref_loss="orpo", pref_ftx=1.0)
