"""A completion's text decoded once when it finishes (`finish_texts`) is the text that
token-by-token detokenization gives, for byte-level BPE, SentencePiece-style (Metaspace
with byte fallback) and WordPiece tokenizers, with and without special tokens skipped."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.output_processor.detokenizer import IncrementalDetokenizer, finish_texts
from tests.tiny_models import build_tokenizer

CORPUS = ["Unicode: café, naïve, 東京, Ωμέγα, emoji 🙂 and 🙂🙂.", "The quick brown fox jumps over the lazy dog.",
          "Paged attention keeps keys and values in blocks; (a) b, c! d?", "數學 ist schön — ça va très bien"] * 30


def _byte_level(tmp_path):
    build_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def _sentencepiece_style(_):
    """Llama 2's layout: Metaspace words, unknown characters as <0xNN> byte tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_],
                                                        initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz")))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _wordpiece(_):
    """BERT's layout, whose transformers decode cleans up spaces (the per-token path)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("make", [_byte_level, _sentencepiece_style, _wordpiece])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_decoded_at_the_end_equals_the_token_by_token_text(make, skip_special_tokens, tmp_path, monkeypatch):
    tokenizer = make(tmp_path)
    caught_up = []
    catch_up = IncrementalDetokenizer.catch_up
    monkeypatch.setattr(IncrementalDetokenizer, "catch_up", lambda self, ids: caught_up.append(ids) or catch_up(self, ids))
    rng = random.Random(0)
    vocab = len(tokenizer)
    samples = [tokenizer(text, add_special_tokens=False).input_ids for text in CORPUS[:4]]
    cases = []
    for i in range(60):
        if i % 3 == 0:  # random ids: split characters, special tokens, bytes that never complete
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        else:  # real text cut anywhere, split characters at either end included
            sample = rng.choice(samples)
            start = rng.randrange(len(sample))
            ids = sample[start : start + rng.randint(1, 40)]
        cut = rng.randint(0, len(ids))
        cases.append((ids[:cut], ids[cut:]))
    stepped, batched = [], []
    for prompt, output in cases:
        one = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        for token in output:
            one.add_token(token)
        stepped.append(one.text)
        batched.append(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens))
    finish_texts(list(zip(batched, [output for _, output in cases])))
    assert [d.text for d in batched] == stepped
    assert any(text for text in stepped)
    # A fast tokenizer decodes most at once; one that cleans up spaces, token by token.
    assert len(caught_up) == len(cases) if make is _wordpiece else len(caught_up) < len(cases) // 2


def test_finish_texts_catches_up_a_detokenizer_fed_in_part(tmp_path):
    tokenizer = _byte_level(tmp_path)
    ids = tokenizer("café 東京 done", add_special_tokens=False).input_ids
    partial = IncrementalDetokenizer(tokenizer, [5])
    for token in ids[:3]:
        partial.add_token(token)
    finish_texts([(partial, ids)])
    assert partial.text == tokenizer.decode(ids) and partial.finished
    finish_texts([(partial, ids + ids)])  # finished: the text stays
    assert partial.text == tokenizer.decode(ids)
