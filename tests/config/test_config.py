"""Config: defaults load, overrides parse, aliases, errors name key + value + fix, batch arithmetic, CLI exit codes."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config, parse_override, resolve, to_yaml
from hybridflow.config.loader import load_defaults_dict


def test_defaults_load_and_seed_names_exist() -> None:
    cfg = load_config()
    assert cfg.trainer.use_hybrid_engine is True
    assert cfg.trainer.use_colocated_worker is True
    assert cfg.actor_rollout.backend == "hybrid"
    assert cfg.data.use_packed_dataset is True
    assert cfg.trainer.checkpoint.atomic_save is True and cfg.trainer.checkpoint.async_save is True
    for name in ("max_colocate_count", "process_on_nodes"):
        assert hasattr(cfg.resource_pool, name)
    for name in ("num_workers", "prefetch_factor", "persistent_workers"):
        assert hasattr(cfg.data, name)
    for name in ("type", "kl_coef", "target_kl", "horizon"):
        assert hasattr(cfg.algorithm.kl_ctrl, name)
    for name in ("save_freq", "keep_last_n"):
        assert hasattr(cfg.trainer.checkpoint, name)
    for name in ("default_hdfs_dir", "logger", "test_freq", "nnodes", "n_gpus_per_node"):
        assert hasattr(cfg.trainer, name)


def test_config_is_frozen() -> None:
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.nnodes = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "text,expected",
    [("a=1", 1), ("a=1.5", 1.5), ("a=1e-6", 1e-6), ("a=true", True), ("a=False", False), ("a=null", None),
     ("a=[1,2]", [1, 2]), ("a=[x,y]", ["x", "y"]), ("a=hello", "hello"), ("a={b: 1}", {"b": 1})],
)
def test_parse_override_types(text: str, expected: object) -> None:
    assert parse_override(text) == ("a", expected)


def test_overrides_and_alias() -> None:
    cfg = load_config(overrides=["trainer.checkpoint.atomic_save=false", "algorithm.kl_ctrl.type=kl_controller",
                                 "actor.optim.lr=3e-6", "trainer.logger=[console,jsonl,tensorboard]"])
    assert cfg.trainer.checkpoint.atomic_save is False
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.trainer.logger == ["console", "jsonl", "tensorboard"]


def test_yaml_file_then_override_order(tmp_path) -> None:
    f1 = tmp_path / "a.yaml"
    f1.write_text(yaml.safe_dump({"trainer": {"experiment_name": "from_file", "total_epochs": 3}}))
    cfg = load_config([f1], ["trainer.total_epochs=5"])
    assert cfg.trainer.experiment_name == "from_file"
    assert cfg.trainer.total_epochs == 5
    assert cfg.trainer.run_dir == "runs/hybridflow/from_file"  # ${...} interpolation follows the file


def test_unknown_key_suggests() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.checkpont.*Did you mean 'trainer\.checkpoint'"):
        load_config(overrides=["trainer.checkpont.save_freq=1"])


def test_removed_key_in_an_old_config_warns_with_the_fix(tmp_path, caplog) -> None:
    old = tmp_path / "config.yaml"  # e.g. a run directory's config.yaml from before the key was removed
    old.write_text(yaml.safe_dump({"rollout": {"block_size": 16, "n": 2}}))
    with caplog.at_level("WARNING", logger="hybridflow.config.loader"):
        cfg = load_config([old])
    assert cfg.rollout.n == 2 and not hasattr(cfg.rollout, "block_size")
    assert "config key 'rollout.block_size' was removed and is ignored" in caplog.text
    assert "delete it from your config" in caplog.text


def test_bad_type_names_key_and_value() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.nnodes='two'.*integer"):
        load_config(overrides=["trainer.nnodes=two"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature=0\.0.*do_sample=false"):
        load_config(overrides=["rollout.temperature=0"])
    with pytest.raises(ConfigError, match=r"algorithm\.kl_ctrl\.type='pid'.*'fixed', 'adaptive'"):
        load_config(overrides=["algorithm.kl_ctrl.type=pid"])


def test_actor_rollout_backend_only_hybrid() -> None:
    with pytest.raises(ConfigError, match=r"actor_rollout\.backend='vllm'.*only 'hybrid'"):
        load_config(overrides=["actor_rollout.backend=vllm"])


def test_process_on_nodes_shape_errors_name_both_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["trainer.nnodes=4", "resource_pool.process_on_nodes=[8,8]"])
    msg = str(err.value)
    assert "resource_pool.process_on_nodes=[8, 8]" in msg and "trainer.nnodes=4" in msg
    with pytest.raises(ConfigError, match=r"process_on_nodes\[1\]=9.*n_gpus_per_node=8"):
        load_config(overrides=["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "resource_pool.process_on_nodes=[8,9]"])
    ok = load_config(overrides=["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "resource_pool.process_on_nodes=[8,4]",
                             "data.train_batch_size=48", "actor.ppo_mini_batch_size=12"])
    assert resolve(ok).world_size == 12


def test_batch_arithmetic_messages() -> None:
    with pytest.raises(ConfigError, match=r"32 / 12 = 2\.67 mini-batches"):
        load_config(overrides=["actor.ppo_mini_batch_size=12"])
    with pytest.raises(ConfigError, match=r"16 prompts x rollout.n=1 = 16 samples .* 16 / 3 = 5\.33"):
        load_config(overrides=["trainer.n_gpus_per_node=3"])
    with pytest.raises(ConfigError, match=r"= 64 samples per process, not a multiple of actor.ppo_micro_batch_size_per_gpu=6"):
        load_config(overrides=["rollout.n=4", "actor.ppo_micro_batch_size_per_gpu=6"])


def test_resolved_numbers_not_written_back() -> None:
    cfg = load_config(overrides=["rollout.n=4", "trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=8"])
    r = resolve(cfg)
    assert r.samples_per_step == 32 * 4
    assert r.actor.mini_batch_samples == 64 and r.actor.mini_batch_samples_per_gpu == 32
    assert r.actor.grad_accum_steps == 4 and r.actor.num_mini_batches == 2
    assert r.recompute_old_log_prob is True  # two mini-batches → off-policy after the first
    assert cfg.actor.ppo_mini_batch_size == 16  # config unchanged
    assert resolve(load_config(overrides=["actor.ppo_mini_batch_size=32"])).recompute_old_log_prob is False
    # the KL loss compares the update's own log-probs with the reference's: no old-policy pass needed; the KL in
    # the reward is measured on the driver from the recomputed log-probs
    on_policy = ["actor.ppo_mini_batch_size=32"]
    assert resolve(load_config(overrides=[*on_policy, "actor.use_kl_loss=true"])).recompute_old_log_prob is False
    assert resolve(load_config(overrides=[*on_policy, "algorithm.use_kl_in_reward=true"])).recompute_old_log_prob


def test_colocation_needs_count() -> None:
    with pytest.raises(ConfigError, match=r"max_colocate_count=1.*set resource_pool.max_colocate_count=2"):
        load_config(overrides=["trainer.use_colocated_worker=false", "algorithm.adv_estimator=gae"])


def test_show_roundtrips_through_yaml() -> None:
    cfg = load_config(overrides=["trainer.experiment_name=x1"])
    again = yaml.safe_load(to_yaml(cfg))
    assert again["trainer"]["experiment_name"] == "x1"
    assert set(again) >= set(load_defaults_dict())


def test_cli_config_exit_codes(capsys) -> None:
    assert main(["config", "show", "trainer.checkpoint.atomic_save=false", "algorithm.kl_ctrl.type=kl_controller"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["trainer"]["checkpoint"]["atomic_save"] is False
    assert out["algorithm"]["kl_ctrl"]["type"] == "adaptive"
    assert main(["config", "validate", "trainer.nnodes=4", "resource_pool.process_on_nodes=[8,8]"]) == 2
    err = capsys.readouterr().err
    assert "trainer.nnodes" in err and "resource_pool.process_on_nodes" in err
    assert main(["config", "validate", "trainer.checkpont.save_freq=1"]) == 2
    assert "trainer.checkpoint" in capsys.readouterr().err


def test_tensor_parallel_generation_errors_name_the_keys() -> None:
    tp = "rollout.tensor_model_parallel_size"
    with pytest.raises(ConfigError, match=rf"{tp}=2 must divide the actor's 3 processes .*n_gpus_per_node=3.* e\.g\. 1"):
        load_config(overrides=[f"{tp}=2", "trainer.n_gpus_per_node=3", "data.train_batch_size=48",
                               "actor.ppo_mini_batch_size=12"])
    with pytest.raises(ConfigError, match=rf"{tp}=2 with trainer.mode=async.*trainer.mode=sync"):
        load_config(overrides=[f"{tp}=2", "trainer.n_gpus_per_node=2", "trainer.mode=async"])
    with pytest.raises(ConfigError, match=rf"{tp}=2 with rollout.multi_turn.enable=true"):
        load_config(overrides=[f"{tp}=2", "trainer.n_gpus_per_node=2", "rollout.multi_turn.enable=true"])
    for online in ("true", "false"):
        with pytest.raises(ConfigError, match=rf"{tp}=2 with hybridflow dpo"):
            load_config(overrides=[f"{tp}=2", "trainer.n_gpus_per_node=2", f"dpo.online={online}", "rollout.n=4"],
                        command="dpo")
    assert load_config(overrides=[f"{tp}=2", "trainer.n_gpus_per_node=4"]).rollout.tensor_model_parallel_size == 2
