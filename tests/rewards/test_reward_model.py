"""The in-process reward model: a tiny sequence-classification model and its tokenizer built
here (no download), loaded by the configuration's `path`, scoring real rollouts on the test LLM."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from lightning_middleware import RewardConfig, TraceStore, rollout  # noqa: E402
from lightning_middleware.rewards import ConfigError, RewardModelError, Scorer  # noqa: E402
from tests.rewards.helpers import client_for, tool_agent  # noqa: E402

WORDS = ["[UNK]", "[PAD]", "echo", "task", "transcript", "final", "answer", "ok", "error", "fix", "it", "4"]


def _tiny_classifier(out: Path, num_labels: int) -> Path:
    torch.manual_seed(0)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                         model_max_length=256).save_pretrained(out)
    cfg = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=256, num_labels=num_labels)
    transformers.BertForSequenceClassification(cfg).save_pretrained(out)
    return out


@pytest.mark.parametrize("num_labels", [1, 2])
def test_a_local_classifier_scores_rollouts(store: TraceStore, tmp_path: Path, num_labels: int) -> None:
    path = _tiny_classifier(tmp_path / "rm", num_labels)
    cfg = RewardConfig.from_dict({"reward_type": "model", "reward_model": {"path": str(path), "weight": 2.0}})
    client = client_for(store)
    ids = []
    for question, result in (("fix it", "ok"), ("fix it", "error error error")):
        with rollout("t", store=store, rewards=cfg) as r:
            tool_agent(client, question, result)
        ids.append(r.id)
    got = [{x.name: x for x in store.rewards(rid) if x.config_hash == cfg.hash} for rid in ids]
    values = [g["reward_model"].value for g in got]
    logits = [g["reward_model"].metadata["detail"]["logits"] for g in got]
    assert all(len(lg) == num_labels for lg in logits) and values[0] != values[1]  # it reads the transcript
    if num_labels == 1:
        assert values == pytest.approx([lg[0] for lg in logits], abs=1e-5)
    else:
        assert all(0 < v < 1 for v in values)
        assert values[0] == pytest.approx(1 / (1 + math.exp(logits[0][0] - logits[0][1])), abs=1e-5)
    assert [g["final"].value for g in got] == pytest.approx([2.0 * v for v in values])
    # Scoring again gives the same number (eval mode, no dropout).
    assert Scorer(cfg).score_rollout(store, ids[0]).scored.values["reward_model"] == pytest.approx(values[0])


def test_a_bad_model_path_or_two_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(RewardModelError, match="is not a sequence-classification model"):
        Scorer(RewardConfig.from_dict({"reward_type": "model", "reward_model": {"path": str(tmp_path)}}))
    with pytest.raises(ConfigError, match="exactly one of url"):
        RewardConfig.from_dict({"reward_type": "model", "reward_model": {"path": "x", "scorer": "a:b"}})
