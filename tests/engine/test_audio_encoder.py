"""The shared Whisper-style audio encoder against transformers' `WhisperEncoder` and
`Qwen2AudioEncoder` (float32, tiny random configs): the same parameter names (a state dict
loads strictly), the same rows, Qwen2-Audio's key-padding mask and pooled lengths."""

import pytest
import torch
import transformers
from transformers.masking_utils import create_bidirectional_mask

from engine.layers.linear import Linear
from engine.models.audio_encoder import AudioEncoder, conv_rows, pooled_rows

# Two layers of width 32 over 80 mel bins; 100 positions, so a 200-frame window (a 2 s extractor's).
TINY = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
            max_source_positions=100)
WINDOW = 2 * TINY["max_source_positions"]


def ours_from(reference: torch.nn.Module, config: transformers.PretrainedConfig, avg_pool: bool) -> AudioEncoder:
    """Our encoder with the reference's weights, loaded by name (strict), then prepacked as a model is."""
    encoder = AudioEncoder(config, avg_pool=avg_pool)
    encoder.load_state_dict(reference.state_dict(), strict=True)
    for module in encoder.modules():
        if isinstance(module, Linear):
            module.prepack()
    return encoder.eval()


def features(clips: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(clips, TINY["num_mel_bins"], WINDOW, generator=generator)


def test_matches_whisper_encoder():
    config = transformers.WhisperConfig(**TINY, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64)
    torch.manual_seed(0)
    reference = transformers.models.whisper.modeling_whisper.WhisperEncoder(config).eval()
    ours = ours_from(reference, config, avg_pool=False)
    batch = features(3)
    with torch.no_grad():
        expected = reference(batch).last_hidden_state
        got = ours(batch)
    assert got.shape == (3, TINY["max_source_positions"], TINY["d_model"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_matches_qwen2_audio_encoder_with_padding_mask():
    """Clips of their own frame counts in one padded batch: the keys past each clip's conv
    rows are masked as Qwen2AudioModel masks them, and the pooled rows are equal."""
    config = transformers.Qwen2AudioEncoderConfig(**TINY)
    torch.manual_seed(1)
    reference = transformers.models.qwen2_audio.modeling_qwen2_audio.Qwen2AudioEncoder(config).eval()
    ours = ours_from(reference, config, avg_pool=True)
    mel_frames = torch.tensor([WINDOW, 117, 31])
    batch = features(3, seed=1)
    conv = conv_rows(mel_frames)
    valid = (torch.arange(TINY["max_source_positions"]) < conv[:, None]).long()
    mask = create_bidirectional_mask(config=config, inputs_embeds=torch.zeros(3, TINY["max_source_positions"], 1),
                                     attention_mask=valid)
    with torch.no_grad():
        expected = reference(batch, attention_mask=mask).last_hidden_state
        got = ours(batch, mel_frames)
        unmasked = ours(batch)
    assert got.shape == (3, TINY["max_source_positions"] // 2, TINY["d_model"])
    _, lengths = reference._get_feat_extract_output_lengths(mel_frames)
    assert pooled_rows(mel_frames).tolist() == lengths.tolist() == [50, 29, 8]
    for clip, rows in enumerate(lengths.tolist()):  # the rows a clip's tokens take
        torch.testing.assert_close(got[clip, :rows], expected[clip, :rows], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], unmasked[0], rtol=1e-5, atol=1e-5)  # a full clip masks nothing
    assert not torch.allclose(got[2, :8], unmasked[2, :8], atol=1e-3)  # the mask matters for a short one


def test_features_longer_than_the_window_are_refused():
    encoder = AudioEncoder(transformers.Qwen2AudioEncoderConfig(**TINY))
    with pytest.raises(ValueError, match="more than the encoder's 100 positions"):
        encoder(torch.zeros(1, TINY["num_mel_bins"], WINDOW + 2))
