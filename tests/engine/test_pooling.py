"""Pooling models against transformers (and sentence-transformers) in float32: `LLM.embed`
for each pooling type, `LLM.classify`, `LLM.score` with embeddings and with a
cross-encoder, through chunked prefill, the prefix cache and preemption."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine import LLM, PoolingParams, SamplingParams
from engine.entrypoints.inputs import RequestChecker
from tests.tiny_models import build_tiny_model, build_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A",
    "A paged KV cache stores keys and values in fixed-size blocks. " * 6,
    "A paged KV cache stores keys and values in fixed-size blocks. " * 6 + "And then some.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]
FAMILIES = ("llama", "qwen2", "qwen3", "gemma2")


def save_with_tokenizer(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory) -> dict[str, Path]:
    """Per family: the causal LM, its bare decoder saved as `XModel` ("<family>-model"),
    a 3-label classifier and a cross-encoder (1 label), the heads random."""
    root = tmp_path_factory.mktemp("pooling_models")
    folders = {}
    for family in FAMILIES:
        causal = build_tiny_model(root / family, family)
        folders[family] = causal
        folders[f"{family}-model"] = save_with_tokenizer(
            transformers.AutoModel.from_pretrained(causal, dtype=torch.float32), root / f"{family}-model")
        for labels, name in ((3, "classifier"), (1, "cross-encoder")):
            config = transformers.AutoConfig.from_pretrained(causal, num_labels=labels)
            torch.manual_seed(labels)
            model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
            model.model.load_state_dict(transformers.AutoModel.from_pretrained(causal).state_dict())
            folders[f"{family}-{name}"] = save_with_tokenizer(model, root / f"{family}-{name}")
    return folders


def hidden_states(folder: Path, text: str) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).last_hidden_state[0]


def pooled(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_pooled_hidden_states(pooling_models, family, pooling_type):
    """Each pooling type over prompts of 1 to 80 tokens, computed in chunks of 16 tokens
    (so MEAN sums over several steps), normalised to unit length."""
    folder = pooling_models[f"{family}-model"]
    with LLM(str(folder), dtype="float32", pooling_type=pooling_type, max_num_batched_tokens=16) as llm:
        outputs = llm.embed(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        expected = F.normalize(pooled(hidden_states(folder, text), pooling_type), dim=0)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)


def test_a_causal_lm_embeds_with_runner_pooling(pooling_models):
    """runner='pooling' on a causal LM checkpoint (as Qwen3-Embedding ships): its decoder's
    last hidden state, the LM head unused; normalize=False keeps the raw vector."""
    folder = pooling_models["qwen3"]
    with LLM(str(folder), dtype="float32", runner="pooling") as llm:
        outputs = llm.embed(TEXTS[:3], PoolingParams(normalize=False), use_tqdm=False)
        unit = llm.embed(TEXTS[:3], use_tqdm=False)
    for text, raw, normed in zip(TEXTS, outputs, unit):
        expected = hidden_states(folder, text)[-1]
        torch.testing.assert_close(torch.tensor(raw.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(normed.outputs.embedding), F.normalize(expected, dim=0),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling_mode", ["lasttoken", "mean"])
def test_embeddings_equal_sentence_transformers(pooling_models, tmp_path, pooling_mode):
    """A sentence-transformers folder (Transformer, Pooling, Normalize) is detected as an
    embedding model, its pooling mode read from its modules: the same vectors as
    `SentenceTransformer.encode`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    body = Transformer(str(pooling_models["llama-model"]))
    pooling = Pooling(body.get_embedding_dimension(), pooling_mode=pooling_mode)
    reference = SentenceTransformer(modules=[body, pooling, Normalize()], device="cpu")
    reference.save(str(tmp_path / "st"))
    expected = reference.encode(TEXTS, convert_to_tensor=True, batch_size=1)
    with LLM(str(tmp_path / "st"), dtype="float32") as llm:
        assert llm.llm_engine.model_config.pooler.pooling_type == {"lasttoken": "LAST", "mean": "MEAN"}[pooling_mode]
        outputs = llm.embed(TEXTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outputs]), expected.float(),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling_type", ["LAST", "CLS", "MEAN"])
def test_the_last_layer_computes_the_rows_a_step_reads(pooling_models, pooling_type):
    """Every row's key and value reach the cache, but the last layer's MLP sees only the
    rows whose final hidden states the step reads: a prompt's last row (LAST), its first
    (CLS), all of them (MEAN); for a generating prompt the row it samples from."""
    def rows_through(llm, run) -> tuple[int, int]:
        layers = llm.llm_engine.model_runner.model.model.layers
        seen = {0: 0, 1: 0}
        hooks = [layer.mlp.register_forward_pre_hook(lambda _, args, i=i: seen.__setitem__(i, seen[i] + len(args[0])))
                 for i, layer in enumerate((layers[0], layers[-1]))]
        run()
        for hook in hooks:
            hook.remove()
        return seen[0], seen[1]

    texts = TEXTS[:4]
    with LLM(str(pooling_models["llama-model"]), dtype="float32", pooling_type=pooling_type) as llm:
        first, last = rows_through(llm, lambda: llm.embed(texts, use_tqdm=False))
    assert last == (first if pooling_type == "MEAN" else len(texts)) and first > 4 * len(texts)
    with LLM(str(pooling_models["llama"]), dtype="float32") as llm:
        first, last = rows_through(llm, lambda: llm.generate(texts, SamplingParams(max_tokens=1), use_tqdm=False))
    assert last == len(texts) and first > 4 * len(texts)


def test_last_token_pooling_reuses_cached_prefixes(pooling_models):
    """Prompts sharing a long prefix hit the prefix cache under LAST pooling, with the
    vectors of a cold run; MEAN pooling computes every position."""
    folder = pooling_models["llama-model"]
    with LLM(str(folder), dtype="float32") as llm:
        cold = llm.embed(TEXTS[3:4], use_tqdm=False)
        before = llm.get_stats().num_cached_prompt_tokens
        warm = llm.embed(TEXTS[3:5], use_tqdm=False)
        assert llm.get_stats().num_cached_prompt_tokens - before >= 2 * 48
        torch.testing.assert_close(torch.tensor(warm[0].outputs.embedding), torch.tensor(cold[0].outputs.embedding))
    with LLM(str(folder), dtype="float32", pooling_type="MEAN") as llm:
        llm.embed(TEXTS[3:4], use_tqdm=False)
        llm.embed(TEXTS[3:5], use_tqdm=False)
        assert llm.get_stats().num_cached_prompt_tokens == 0


def test_pooling_is_batched_and_survives_preemption(pooling_models):
    """Fifty prompts run in steps filled to the token budget; a MEAN-pooled prompt
    preempted after its first chunk (the scheduler's own preemption, between steps) is
    pooled again from its first token, to the same vector."""
    folder = pooling_models["qwen2-model"]
    texts = [f"{i} " + TEXTS[i % len(TEXTS)] for i in range(50)]
    with LLM(str(folder), dtype="float32", pooling_type="MEAN") as llm:
        expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats.num_steps <= -(-stats.num_prompt_tokens_computed // 1024) + 1  # full 1,024-token steps
    with LLM(str(folder), dtype="float32", pooling_type="MEAN", max_num_batched_tokens=32) as llm:
        engine = llm.llm_engine
        [row] = RequestChecker(engine).check_pooling([texts[3]], None, None)
        row.request.submit(engine, "long")
        engine.step()
        [seq] = engine.scheduler.running
        assert 0 < seq.num_computed_tokens < seq.num_tokens
        assert engine.model_runner.input_batch.rows[seq].pooling_state is not None
        engine.scheduler._preempt(seq)
        finished = []
        while engine.has_unfinished_requests():
            finished += engine.step_requests()
        assert seq.metrics.num_preemptions == 1
        got = engine.output(finished[0]).outputs.embedding
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected[3]), atol=1e-5, rtol=1e-4)
    token_bytes = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    with LLM(str(folder), dtype="float32", kv_cache_memory=8 * 16 * token_bytes) as llm:
        with pytest.raises(ValueError, match="row 0, prompt: needs 246 tokens of KV cache, which holds 128"):
            llm.embed([TEXTS[3]])


@pytest.mark.parametrize("family", FAMILIES)
def test_classify_equals_transformers(pooling_models, family):
    folder = pooling_models[f"{family}-classifier"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=16) as llm:
        outputs = llm.classify(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        with torch.no_grad():
            expected = model(tokenizer(text, return_tensors="pt").input_ids).logits[0].softmax(-1)
        assert output.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=1e-5, rtol=1e-4)


def test_score_with_a_cross_encoder_equals_transformers(pooling_models):
    """A one-label classifier scores each pair read as one input: the sigmoid of its
    logit; one text_1 is paired with every text_2."""
    folder = pooling_models["qwen2-cross-encoder"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    query, documents = TEXTS[0], TEXTS[1:4]
    with LLM(str(folder), dtype="float32") as llm:
        outputs = llm.score(query, documents, use_tqdm=False)
    for document, output in zip(documents, outputs):
        with torch.no_grad():
            logit = model(tokenizer(query, document, return_tensors="pt").input_ids).logits[0, 0]
        assert output.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)


def test_score_with_an_embedding_model_is_the_cosine(pooling_models):
    folder = pooling_models["llama-model"]
    with LLM(str(folder), dtype="float32") as llm:
        scores = llm.score(TEXTS[:3], TEXTS[3:], use_tqdm=False)
        embedded = [torch.tensor(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)]
    for i, output in enumerate(scores):
        expected = F.cosine_similarity(embedded[i], embedded[3 + i], dim=0).item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-6)


def test_wrong_calls_say_what_to_do(pooling_models):
    with LLM(str(pooling_models["llama-model"]), dtype="float32") as llm:
        with pytest.raises(ValueError, match="this model pools .* call embed or score"):
            llm.generate(["hi"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="task is 'embed', not 'classify'"):
            llm.classify(["hi"])
        with pytest.raises(ValueError, match="row 1, prompt: is empty"):
            llm.embed(["hi", ""])
        with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
            llm.score(["a", "b"], ["c", "d", "e"])
    with LLM(str(pooling_models["llama-classifier"]), dtype="float32") as llm:
        with pytest.raises(ValueError, match="3 labels; a cross-encoder has one"):
            llm.score("a", "b")
    with LLM(str(pooling_models["llama"]), dtype="float32") as llm:
        with pytest.raises(ValueError, match=r"this model generates text.*runner='pooling'"):
            llm.embed(["hi"])
    with pytest.raises(ValueError, match="has no language-model head to generate with"):
        LLM(str(pooling_models["llama-model"]), runner="generate")
    with pytest.raises(ValueError, match="pooling_type must be None or one of"):
        LLM(str(pooling_models["llama-model"]), pooling_type="max")


def test_tensor_parallel_ranks_pool_and_classify_as_one(pooling_models):
    """Two ranks (gloo, on the CPU): rank 0 pools the hidden states the ranks computed
    together and applies the classifier's head: transformers' probabilities."""
    folder = pooling_models["qwen2-classifier"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with LLM(str(folder), dtype="float32", tensor_parallel_size=2) as llm:
        outputs = llm.classify(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        with torch.no_grad():
            expected = model(tokenizer(text, return_tensors="pt").input_ids).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=1e-5, rtol=1e-4)
