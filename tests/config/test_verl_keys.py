"""verl's key names load as hybridflow's: verl's GSM8K GRPO example override list (adapted to the tiny model and
data) resolves to the values it means, in overrides and YAML files; keys without an equivalent name themselves
and why; every mapping logs a line; the docs table lists every key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from hybridflow.config import ConfigError, load_config
from hybridflow.config.loader import get_dotted, load_defaults_dict
from hybridflow.config.verl_keys import NO_EQUIVALENT, VERL_KEYS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "verl-keys.md"


def _grpo_example(train: str) -> list[str]:
    """verl's examples/grpo_trainer/run_qwen2-7b.sh override list, sizes and paths made tiny (model path → the
    tiny preset: model.path stays null), plus keys from its PPO example and Dr.GRPO/DAPO recipes."""
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files={train}",
        "data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=16",
        "data.filter_overlong_prompts=True", "data.truncation='error'",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=['console']", "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.save_freq=-1", "trainer.test_freq=5", "trainer.total_epochs=15",
        "actor_rollout_ref.actor.optim.warmup_style=cosine", "algorithm.norm_adv_by_std_in_grpo=False",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    ]


@pytest.fixture
def gsm8k_like(tmp_path) -> str:
    from hybridflow.data.parquet_io import write_rows

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(16)]
    return str(write_rows(rows, tmp_path / "train.parquet"))


def test_verl_example_overrides_resolve_to_their_meaning(gsm8k_like, caplog) -> None:
    caplog.set_level(logging.INFO, logger="hybridflow.config.verl_keys")
    cfg = load_config([], [*_grpo_example(gsm8k_like), "trainer.device=cpu"])
    assert cfg.rollout.n == 4 and cfg.rollout.name == "hybrid" and cfg.rollout.gpu_memory_utilization == 0.6
    assert cfg.actor.ppo_mini_batch_size == 4 and cfg.actor.ppo_micro_batch_size_per_gpu == 4  # prompts / samples
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 8 and cfg.ref.log_prob_micro_batch_size_per_gpu == 8
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.001 and cfg.actor.kl_loss_type == "low_var_kl"
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.optim.lr_scheduler == "cosine"
    assert cfg.actor.fsdp.param_offload is False and cfg.ref.fsdp.param_offload is True
    assert cfg.actor.clip_ratio_high == 0.28 and cfg.rollout.val_kwargs.do_sample is True
    assert cfg.model.enable_gradient_checkpointing and cfg.data.use_packed_dataset
    assert cfg.algorithm.norm_adv_by_std is False and cfg.critic.warmup_steps == 0
    assert cfg.data.truncation == "filter"  # verl filters over-long prompts before truncation='error' applies
    assert cfg.trainer.checkpoint.save_freq == 0  # verl's -1 never saves; our -1 would save at the end
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.test_freq == 5
    assert "verl key actor_rollout_ref.rollout.n → hybridflow key rollout.n" in caplog.text
    assert "verl key trainer.save_freq → hybridflow key trainer.checkpoint.save_freq" in caplog.text


def test_verl_keys_in_a_yaml_file(tmp_path) -> None:
    doc = {"actor_rollout_ref": {"rollout": {"n": 8, "name": "sglang"},
                                 "actor": {"ppo_mini_batch_size": 8, "fsdp_config": {"optimizer_offload": True}}},
           "critic": {"model": {"path": "/some/critic"}, "optim": {"lr": 2e-5}},
           "custom_reward_function": {"name": "my_score"},
           "model": {"override_config": {"num_hidden_layers": 2}}}
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_config([path], validate=False)
    assert cfg.rollout.n == 8 and cfg.rollout.name == "hybrid" and cfg.actor.ppo_mini_batch_size == 8
    assert cfg.actor.fsdp.optimizer_offload is True and cfg.critic.model_path == "/some/critic"
    assert cfg.critic.optim.lr == 2e-5 and cfg.reward.custom.name == "my_score"
    assert cfg.model.override_config == {"num_hidden_layers": 2}  # free-form mappings stay whole


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "no sequence parallelism"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.engine_kwargs.x=1", "docs/verl-keys.md"),
    ("reward_model.reward_manager=dapo", "reward.overlong_buffer"),
])
def test_verl_keys_without_equivalent_name_key_and_why(override, expected) -> None:
    with pytest.raises(ConfigError, match="verl key") as err:
        load_config([], [override])
    assert override.split("=")[0] in str(err.value) and expected in str(err.value)
    assert "Did you mean" not in str(err.value)


def test_rollout_tensor_parallel_size_maps_to_ours() -> None:
    cfg = load_config([], ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"])
    assert cfg.rollout.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="rollout.tensor_model_parallel_size"):
        load_config([], ["rollout.tensor_model_parallel_size=0"])


def test_every_mapping_targets_a_real_key_and_is_documented() -> None:
    defaults = load_defaults_dict()
    for entry in VERL_KEYS.values():
        if entry.ours is not None:
            get_dotted(defaults, entry.ours)  # raises for a key that does not exist
    text = DOCS.read_text()
    missing = [k for k in (*VERL_KEYS, *NO_EQUIVALENT) if f"`{k}`" not in text]
    assert not missing, f"docs/verl-keys.md lacks {missing}"


def test_one_training_step_with_the_verl_example(gsm8k_like, tmp_path) -> None:
    from hybridflow.trainer.run import run_ppo

    cfg = load_config([], [*_grpo_example(gsm8k_like), "trainer.device=cpu", "trainer.backend=local",
                           "trainer.logger=[]", "trainer.total_training_steps=1", "trainer.val_before_train=false",
                           f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt",
                           "data.val_files=[]"])
    history = run_ppo(cfg)
    assert len(history) == 1 and "actor/pg_loss" in history[0] and "actor/kl_loss" in history[0]
