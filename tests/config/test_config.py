"""Config: YAML + overrides, validation errors that name the key and what is allowed."""

from __future__ import annotations

import pytest
import yaml

from peergrade.config import Config, ConfigError, all_keys, load_config, to_markdown, to_yaml


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    assert cfg == Config()
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_overrides_beat_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"algo": {"beta": 0.1, "clip_eps": 0.3}, "train": {"steps": 7}}))
    cfg = load_config(path, [("algo.beta", 0.04), ("data.task_options.max_digits", 3)])
    assert cfg.algo.beta == 0.04
    assert cfg.algo.clip_eps == 0.3  # from the file, untouched by the override
    assert cfg.train.steps == 7
    assert cfg.data.task_options == {"max_digits": 3}


def test_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML parses `1e-5` as a string; a user writing it must still get a float
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-5\n")
    assert load_config(path).optim.lr == 1e-5
    assert load_config(None, [("optim.lr", "5e-4")]).optim.lr == 5e-4
    with pytest.raises(ConfigError, match="optim.lr: expected a number"):
        load_config(None, [("optim.lr", "fast")])


def test_int_widens_to_float_but_not_the_reverse():
    assert isinstance(load_config(None, [("algo.beta", 1)]).algo.beta, float)
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_config(None, [("train.steps", 2.5)])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (("algo.bta", 0.1), "unknown config key 'algo.bta'; did you mean 'algo.beta'"),
        (("trian.steps", 3), "did you mean 'train'"),
        (("algo.loss_type", "grpoo"), "choose one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo'"),
        (("rollout.group_size", 1), "rollout.group_size must be >= 2"),
        (("optim.lr", -1e-5), "optim.lr must be > 0"),
        (("algo.clip_eps", -0.2), "algo.clip_eps must be > 0"),
        (("algo.clip_eps_high", 0.0), "algo.clip_eps_high must be > 0"),
        (("optim.minibatch_size", 7), "optim.minibatch_size (7) must divide the batch"),
        (("optim.micro_batch_size", 5), "optim.micro_batch_size (5) must divide the minibatch"),
        (("rollout.top_p", 1.5), "rollout.top_p must be in (0, 1]"),
        (("algo.kl_estimator", "k4"), "choose one of 'k1', 'k2', 'k3'"),
        (("algo.beta.x", 1), "is a value, not a section"),
        (("model.lora.r", "big"), "model.lora.r: expected an integer"),
        (("train.on_reward_error", "ignore"), "choose one of 'fail', 'zero'"),
        (("data.few_shot", -1), "data.few_shot must be >= 0"),
        (("data.few_shot_fade_steps", -2), "data.few_shot_fade_steps must be >= 0"),
        (("algo.loss_type", "sapo2"), "'cispo', 'sapo', 'luspo', 'vespo'"),
        (("algo.delta", 1.0), "algo.delta must be > 1"),
        (("algo.sapo_temperature_neg", 0.0), "algo.sapo_temperature_neg must be > 0"),
        (("algo.vespo_lambda_pos", -1.0), "algo.vespo_lambda_pos must be >= 0"),
        (("algo.off_policy_mask_threshold", 0.0), "algo.off_policy_mask_threshold must be > 0"),
        (("algo.top_entropy_quantile", -0.1), "algo.top_entropy_quantile must be in [0, 1]"),
        (("algo.entropy_coef_delta", -0.1), "algo.entropy_coef_delta must be >= 0"),
        (
            ("algo.entropy_coef_min", 2.0),
            "algo.entropy_coef_min (2.0) must be <= algo.entropy_coef_max",
        ),
        (("algo.multi_objective_aggregation", "sum"), "choose one of 'sum_then_normalize'"),
    ],
)
def test_bad_values_name_key_and_allowed(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([("algo.loss_type", "sapo"), ("algo.delta", 4.0)], "no effect with algo.loss_type='sapo'"),
        ([("algo.loss_type", "vespo"), ("algo.ratio_level", "sequence")], "set algo.ratio_level"),
        (
            [("algo.loss_type", "vespo"), ("algo.off_policy_correction", "sequence_tis")],
            "'sequence_tis' is not supported with it",
        ),
        ([("algo.name", "ppo"), ("algo.entropy_coef", 0.01)], "algo.entropy_coef=0.01 is a GRPO"),
    ],
)
def test_variant_combinations_are_checked(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout.group_size'"):
        load_config(path)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(listy)


def test_rewards_list_items_are_checked():
    cfg = load_config(None, [("rewards", [{"name": "format", "weight": 0.5}])])
    assert cfg.rewards[0].name == "format" and cfg.rewards[0].weight == 0.5
    with pytest.raises(ConfigError, match=r"rewards\[0\].wieght"):
        load_config(None, [("rewards", [{"name": "format", "wieght": 0.5}])])


def test_every_field_is_documented_in_yaml_and_markdown():
    text = to_yaml(Config())
    md = to_markdown()
    for key in all_keys():
        leaf = key.split(".")[-1]
        assert f"{leaf}:" in text
        if not key.startswith("rewards"):
            assert f"`{key}`" in md, key
    # a comment line precedes every key line
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if (
            stripped
            and not stripped.startswith("#")
            and not stripped.startswith("-")
            and ":" in stripped
        ):
            assert lines[i - 1].strip().startswith("#"), f"undocumented: {line}"


def test_base_file_is_read_first_and_overridden(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text(
        "algo: {beta: 0.1, loss_type: dapo}\ndata: {task_options: {min_digits: 1, max_digits: 3}}\n"
    )
    (tmp_path / "sub/mid.yaml").write_text("base: ../root.yaml\nalgo: {beta: 0.2}\n")
    (tmp_path / "sub/leaf.yaml").write_text(
        "base: mid.yaml\ndata: {task_options: {max_digits: 2}}\n"
    )
    cfg = load_config(tmp_path / "sub/leaf.yaml", [("optim.lr", 0.5)])
    assert cfg.algo.beta == 0.2 and cfg.algo.loss_type == "dapo" and cfg.optim.lr == 0.5
    assert cfg.data.task_options == {"max_digits": 2}  # option dicts are replaced, as documented
    # a run's saved config is the merged, standalone one
    assert "base" not in yaml.safe_load(to_yaml(cfg))


def test_base_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"nope.yaml.*the base of .*c.yaml.*does not exist"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: [1]\n")
    with pytest.raises(ConfigError, match="'base' must be a YAML file path"):
        load_config(tmp_path / "d.yaml")


def test_shipped_recipes_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    plain = load_config(root / "smollm2-arith.yaml")
    kl = load_config(root / "smollm2-arith-kl.yaml")
    assert plain.algo.beta == 0.0 and kl.algo.beta == 0.04
    assert plain.data.few_shot == 1 and plain.data.few_shot_fade_steps > 0
    plain.algo.beta = kl.algo.beta
    assert to_yaml(plain) == to_yaml(kl)  # the variant differs in beta alone

    # issue 16's recipe: G = 4, and a G = 8 variant over the same prompts per step
    g4 = load_config(root / "smollm2-add.yaml")
    g8 = load_config(root / "smollm2-add-g8.yaml")
    assert g4.rollout.group_size == 4 and g8.rollout.group_size == 8
    assert g4.rollout.prompts_per_step == g8.rollout.prompts_per_step
    g4.rollout.group_size = 8
    assert to_yaml(g4) == to_yaml(g8)  # nothing else differs


def test_off_and_on_as_the_docs_write_them(tmp_path):
    # YAML 1.1 reads `off` as False: a field whose choices include 'off' takes it as written,
    # in a file and on the command line (whose values are parsed as YAML too)
    from peergrade.cli.common import split_overrides

    path = tmp_path / "c.yaml"
    path.write_text("model:\n  autocast: off\ntrain:\n  audit_rewards: off\n")
    cfg = load_config(path)
    assert cfg.model.autocast == "off" and cfg.train.audit_rewards == "off"
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg  # written back as 'off', read back as 'off'
    cli = split_overrides(["--model.autocast", "off", "--train.audit_rewards", "off"])
    cfg = load_config(None, cli)
    assert cfg.model.autocast == "off" and cfg.train.audit_rewards == "off"
    # a field without an 'on'/'off' choice still refuses a boolean, naming the key
    with pytest.raises(ConfigError, match="model.autocast: True is not allowed"):
        load_config(None, [("model.autocast", True)])
