"""Qwen2-VL and Qwen2.5-VL videos against transformers (float32, tiny random checkpoints):
the video processor's rules against transformers' source (its module needs torchvision, so
its functions are taken out of the file with `ast` and run on a stub), the encoder's rows,
the prompt's M-RoPE positions, greedy generation with videos, images and text mixed, video
files through PyAV, and bad rows."""

import ast
import base64
import dataclasses
import io
import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.image_utils import SizeDict
from transformers.video_utils import VideoMetadata

from engine import LLM, SamplingParams
from engine.models.qwen2_vl import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen2VLVideoRules
from engine.multimodal.image import read_image
from engine.multimodal.video import PromptVideo, VideoInputError, VideoLimits, read_video, sample_indices
from tests.engine.test_vision_engine import kv_token_bytes
from tests.engine.test_vision_qwen2_vl import REFERENCE_CLASSES, chat_text, images, load
from tests.vision_models.qwen2_vl import VIDEO_PROCESSOR, build_tiny_qwen2_vl

PROCESSORS = {"2": Qwen2VLProcessor, "2.5": Qwen2_5_VLProcessor}
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module", params=["2", "2.5"])
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(tmp_path_factory, version) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp(f"qwen{version}_vl_video"), version)


@pytest.fixture(scope="module")
def reference(folder, version) -> transformers.PreTrainedModel:
    return REFERENCE_CLASSES[version].from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(folder, version) -> Qwen2VLProcessor:
    return PROCESSORS[version](folder, transformers.AutoConfig.from_pretrained(folder),
                               transformers.AutoTokenizer.from_pretrained(folder))


def clip(frames: int, height: int, width: int, seed: int, noise: float = 20.0) -> np.ndarray:
    """uint8 frames [frames, height, width, 3]: a square moving over a gradient with `noise`."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, width, dtype=np.float32)[None, :, None]
    video = np.broadcast_to(ramp, (frames, height, width, 3)) + rng.normal(0, noise, (frames, height, width, 3))
    for i in range(frames):
        top, left = (3 * i) % max(1, height - 8), (5 * i) % max(1, width - 8)
        video[i, top : top + 8, left : left + 8] = (255, 40 * seed % 256, 0)
    return video.clip(0, 255).astype(np.uint8)


def videos() -> list:
    """A 6-frame 40x60 clip at 24 fps (no rate given), a 3-frame 50x30 one at 2 fps (its last
    frame repeated to whole temporal patches) and a 4-frame 28x28 one at 1.5 fps."""
    return [clip(6, 40, 60, 1), (clip(3, 50, 30, 2), {"fps": 2.0}), (clip(4, 28, 28, 3), {"fps": 1.5})]


def transformers_video_rules() -> type:
    """transformers' `smart_resize` and `Qwen2VLVideoProcessor`'s `sample_frames`, `resize`
    and `patchify`, taken out of video_processing_qwen2_vl.py (which imports torchvision) as
    a class whose base `resize` returns the size it is asked for."""
    source = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    tree = ast.parse(source.read_text())
    smart_resize = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                        and node.name == "smart_resize")
    processor = next(node for node in tree.body if isinstance(node, ast.ClassDef)
                     and node.name == "Qwen2VLVideoProcessor")
    methods = [node for node in processor.body if isinstance(node, ast.FunctionDef)
               and node.name in ("sample_frames", "resize", "patchify")]
    assert len(methods) == 3
    probe = ast.ClassDef(name="Probe", bases=[ast.Name("Base", ast.Load())], keywords=[], body=methods,
                         decorator_list=[], type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[smart_resize, probe], type_ignores=[]))

    class Base:
        num_frames = fps = None
        max_video_tokens = 128000

        def resize(self, image, size, resample):
            return size.height, size.width

    namespace = {"math": math, "torch": torch, "SizeDict": SizeDict, "VideoMetadata": VideoMetadata, "Base": Base}
    exec(compile(module, str(source), "exec"), namespace)
    return namespace["Probe"]


def test_video_rules_match_transformers_source():
    theirs = transformers_video_rules()()
    for total in (1, 2, 3, 7, 24, 61, 300):
        for source_fps in (10.0, 24.0, 29.97):
            for fps in (0.5, 2.0, 3.7):
                for min_frames, max_frames, patch in ((4, 768, 2), (2, 16, 2), (1, 9, 3)):
                    limits = VideoLimits(fps=fps, min_frames=min_frames, max_frames=max_frames,
                                         temporal_patch_size=patch)
                    try:
                        expected = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=source_fps),
                                                        patch, min_frames, max_frames, fps=fps)
                    except ZeroDivisionError:  # no whole temporal patch: transformers divides by zero
                        with pytest.raises(VideoInputError, match="fewer than"):
                            sample_indices(total, source_fps, limits)
                        continue
                    assert torch.equal(sample_indices(total, source_fps, limits), expected)
    for cap in (False, True):
        for frames in (1, 2, 5, 64, 2000):
            for height, width in ((28, 28), (41, 300), (720, 1280), (1080, 1920), (3, 500)):
                rules = Qwen2VLVideoRules(cap_pixels_per_frame=cap, max_video_tokens=4000)
                theirs.max_video_tokens = 4000
                size = SizeDict(shortest_edge=rules.min_pixels, longest_edge=rules.max_pixels)
                video = torch.empty(()).expand(1, frames, 3, height, width)
                expected = theirs.resize(video, size, None, factor=28, temporal_factor=2, cap_pixels_per_frame=cap)
                assert rules.frame_size(frames, height, width) == expected
    rules = Qwen2VLVideoRules(patch_size=7, merge_size=2, temporal_patch_size=2)
    for frames, height, width in ((4, 28, 28), (3, 42, 56), (1, 14, 70)):
        video = clip(frames, height, width, frames)
        mean, std = (torch.tensor(values)[:, None, None] * 255 for values in (rules.image_mean, rules.image_std))
        normalised = (torch.from_numpy(video).permute(0, 3, 1, 2).float() - mean) / std  # fused, as transformers
        expected, *grid = theirs.patchify(normalised[None], 7, 2, 2)
        assert torch.equal(rules.patches(video), expected[0])
        assert rules.grid(frames, height, width) == tuple(grid)


def test_video_rules_read_from_the_folder(tmp_path):
    """transformers' order of files, and min_pixels / max_pixels over `size`."""
    assert Qwen2VLVideoRules.from_folder(tmp_path) == Qwen2VLVideoRules()
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 12544, "patch_size": 7}')
    assert Qwen2VLVideoRules.from_folder(tmp_path) == Qwen2VLVideoRules(min_pixels=3136, max_pixels=12544, patch_size=7)
    (tmp_path / "video_preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 100, "longest_edge": 900}, "max_pixels": 800, "max_frames": 9}')
    assert Qwen2VLVideoRules.from_folder(tmp_path) == Qwen2VLVideoRules(min_pixels=100, max_pixels=800, max_frames=9)
    (tmp_path / "processor_config.json").write_text('{"video_processor": {"temporal_patch_size": 3}}')
    assert Qwen2VLVideoRules.from_folder(tmp_path) == Qwen2VLVideoRules(temporal_patch_size=3)


def test_video_encoder_matches_transformers(folder, reference, processor):
    model = load(folder)
    read = [read_video(video, processor.video_limits) for video in videos()]
    inputs = [processor.video_inputs(video) for video in read]
    with torch.no_grad():
        expected = reference.get_video_features(torch.cat([i["pixel_values_videos"] for i in inputs]),
                                                torch.cat([i["video_grid_thw"] for i in inputs])).pooler_output
        for video, data, theirs in zip(read, inputs, expected, strict=True):
            ours = model.embed_multimodal(data)
            assert ours.shape == (len(processor.video_tokens(video).replacement), 64)
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert [tuple(i["video_grid_thw"][0].tolist()) for i in inputs] == [(3, 6, 8), (2, 8, 4), (2, 4, 4)]


def reference_inputs(folder: Path, processor: Qwen2VLProcessor, text: str, pictures: list[Image.Image],
                     clips: list[PromptVideo]) -> dict[str, torch.Tensor]:
    """What transformers' processor gives for the prompt, on our pixel tensors: each
    placeholder repeated once per merged row of its item, mm_token_type_ids 1 on image and 2
    on video tokens, and Qwen2.5-VL's second_per_grid_ts."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    inputs: dict[str, torch.Tensor] = {}
    if pictures:
        inputs.update(transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")(
            images=pictures, return_tensors="pt"))
        first, *rest = text.split("<|image_pad|>")
        text = first + "".join("<|image_pad|>" * (int(grid.prod()) // 4) + after
                               for grid, after in zip(inputs["image_grid_thw"], rest))
    if clips:
        data = [processor.video_inputs(video) for video in clips]
        inputs["pixel_values_videos"] = torch.cat([d["pixel_values_videos"] for d in data])
        inputs["video_grid_thw"] = torch.cat([d["video_grid_thw"] for d in data])
        if isinstance(processor, Qwen2_5_VLProcessor):
            inputs["second_per_grid_ts"] = torch.tensor([2 / video.fps for video in clips])
        first, *rest = text.split("<|video_pad|>")
        text = first + "".join("<|video_pad|>" * (int(grid.prod()) // 4) + after
                               for grid, after in zip(inputs["video_grid_thw"], rest))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    types = (ids == processor.image_token_id).int() + 2 * (ids == processor.video_token_id).int()
    return {**inputs, "input_ids": ids, "mm_token_type_ids": types}


@pytest.mark.parametrize("parts", [["video"], ["image", "video"], ["video", "image", "video"], []])
def test_video_rope_positions_match_get_rope_index(folder, reference, processor, parts):
    pictures = images()[1:2] if "image" in parts else []
    clips = [read_video(video, processor.video_limits) for video in videos()[: parts.count("video")]]
    text = chat_text(folder, [{"type": "text", "text": "Compare"}, *({"type": part} for part in parts),
                              {"type": "text", "text": "now."}])
    prompt = processor.apply(processor.tokenizer(text, add_special_tokens=False).input_ids,
                             {"image": [read_image(p) for p in pictures], "video": clips})
    inputs = reference_inputs(folder, processor, text, pictures, clips)
    assert prompt.prompt_token_ids == inputs["input_ids"][0].tolist()
    if not parts:  # transformers counts a text prompt's positions up itself
        expected, delta = torch.arange(len(prompt.prompt_token_ids)).expand(3, -1), 0
    else:
        grids = {key: inputs[key] for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                 if key in inputs}
        positions, deltas = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], **grids)
        expected, delta = positions[:, 0], int(deltas[0, 0])
    assert torch.equal(prompt.rope_positions, expected)
    assert prompt.rope_delta == delta


def test_greedy_generation_with_videos_matches_transformers(folder, reference, processor):
    """Rows with a video, text alone, an image and a video, and the first video again, in one
    batch, as a whole, in chunks of 8 tokens (chunks end inside video tokens) and preempted;
    each distinct video is encoded once; a chat with a video part gives the first row's tokens."""
    given, picture = videos(), images()[2]
    rows = [
        ([{"type": "video"}, {"type": "text", "text": "What happens?"}], [], [given[0]]),
        ([{"type": "text", "text": "Paris is the capital"}], [], []),
        ([{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}], [picture], [given[1]]),
        ([{"type": "text", "text": "Again:"}, {"type": "video"}], [], [given[0]]),
    ]
    expected, prompts = [], []
    for parts, pictures, clips in rows:
        text = chat_text(folder, parts)
        inputs = reference_inputs(folder, processor, text, pictures,
                                  [read_video(video, processor.video_limits) for video in clips])
        with torch.no_grad():
            out = reference.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), do_sample=False,
                                     max_new_tokens=GREEDY.max_tokens)
        expected.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        data = {key: value for key, value in (("image", pictures), ("video", clips)) if value}
        prompts.append({"prompt": text, "multi_modal_data": data} if data else {"prompt": text})
    preempting = {}  # sized by the first run's rows: two of them fit at first, not once they have grown
    for settings in ({}, {"max_num_batched_tokens": 8}, preempting):
        with LLM(str(folder), dtype="float32", quantization=None, **settings) as llm:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected, settings
            stats = llm.get_stats()
            assert (stats.num_videos_encoded, stats.num_images_encoded) == (2, 1), settings
            if settings is preempting:
                assert llm.llm_engine.scheduler.num_preemptions > 0
            if not settings:
                chat = [{"role": "user", "content": [{"type": "video", "video": given[0]},
                                                     {"type": "text", "text": "What happens?"}]}]
                assert llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
        longest = max(len(o.prompt_token_ids) for o in outputs) + GREEDY.max_tokens
        preempting.setdefault("kv_cache_memory", (-(-longest // 16) + 2) * 16 * kv_token_bytes(folder))


def mp4_bytes(frames: np.ndarray, rate: int) -> bytes:
    """The frames encoded as an MP4 (H.264) at `rate` frames per second, by PyAV."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": "10"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def test_video_files_are_sampled_at_the_fps_and_read_alike(folder, processor, tmp_path):
    """A 20-frame 10 fps MP4 (2 s) sampled at 2 fps keeps frames 0, 5, 10 and 15 at 2 fps;
    bytes, a path, a file: and a data: URI read alike, and so does a chat's video_url part."""
    frames = clip(20, 56, 84, 4, noise=0)
    data = mp4_bytes(frames, 10)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    limits = VideoLimits(fps=2.0, min_frames=2, max_frames=16)
    video = read_video(data, limits)
    assert video.frames.shape == (4, 56, 84, 3) and video.fps == 2.0
    errors = np.abs(video.frames[:, None].astype(int) - frames[None].astype(int)).mean(axis=(2, 3, 4))
    assert errors.argmin(axis=1).tolist() == [0, 5, 10, 15]  # lossy, but each nearest the frame it samples
    assert {read_video(form, limits).content_hash for form in (path, str(path), f"file://{path}", uri)} == {
        video.content_hash}
    with LLM(str(folder), dtype="float32", quantization=None) as llm:
        assert read_video(data, llm.video_limits).content_hash == read_video(data, processor.video_limits).content_hash
        slower = read_video(data, dataclasses.replace(llm.video_limits, fps=1.0))  # the docs' way to another rate
        assert len(slower.frames) == 2 and slower.fps == 1.0
        assert read_video((slower.frames, {"fps": slower.fps}), llm.video_limits).content_hash == slower.content_hash
        rows = [{"prompt": llm.video_placeholder + "Hm?", "multi_modal_data": {"video": form}}
                for form in (data, str(path))]
        rows.append({"prompt": chat_text(folder, [{"type": "video"}, {"type": "text", "text": "Hm?"}]),
                     "multi_modal_data": {"video": data}})
        outputs = llm.generate(rows, GREEDY, use_tqdm=False)
        chat = llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                                      {"type": "text", "text": "Hm?"}]}], GREEDY, use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
        assert outputs[2].outputs[0].token_ids == chat[0].outputs[0].token_ids
        assert llm.get_stats().num_videos_encoded == 1
    grid = processor.video_tokens(read_video(data, processor.video_limits)).grid
    assert grid == (2, *(side // 7 for side in processor.video_rules.frame_size(4, 56, 84)))


def test_bad_video_rows_fail_alone_before_any_work(folder):
    """No frames, frames of two sizes, bytes that are no video, more frames than max_frames,
    float frames, a bad fps, more videos than placeholders: each row's own message."""
    with LLM(str(folder), dtype="float32", quantization=None) as llm:
        text = chat_text(folder, [{"type": "video"}, {"type": "text", "text": "Hm?"}])
        good = clip(4, 28, 28, 0)
        mixed = [Image.fromarray(frame) for frame in clip(2, 28, 28, 0)] + [Image.new("RGB", (30, 28))]
        too_many = clip(VIDEO_PROCESSOR["max_frames"] + 1, 28, 28, 0)
        bad = [np.zeros((0, 28, 28, 3), np.uint8), mixed, b"not a video", too_many, good.astype(np.float32),
               (good, {"fps": 0}), [good, good]]
        problems = llm.validate([{"prompt": text, "multi_modal_data": {"video": video}} for video in bad]
                                + [{"prompt": text, "multi_modal_data": {"video": good}}])
    assert problems[-1] is None
    expected = ["no frames", "frame 2 is 28x30 but frame 0 is 28x28", "not a video FFmpeg can decode",
                "17 frames, more than the 16", "float32 array", "fps is 0", "2 video(s) but the prompt has 1"]
    for problem, part in zip(problems, expected, strict=False):
        assert problem is not None and part in problem, (part, problem)
    assert all(p.startswith("multi_modal_data") for p in problems[:-1])


def test_positions_past_the_rotary_tables_are_refused(folder, version):
    """Qwen2.5-VL's temporal positions count time: at 0.04 fps each temporal patch is 50 s,
    200 positions at 4 tokens a second. Four patches run past the tiny model's 512 positions;
    two stay within, but move the generated tokens' positions 150 or more ahead, so 400 new
    tokens do not fit. Qwen2-VL counts temporal patches, and takes every row."""
    with LLM(str(folder), dtype="float32", quantization=None) as llm:
        text = chat_text(folder, [{"type": "video"}, {"type": "text", "text": "Hm?"}])
        rows = [{"prompt": text, "multi_modal_data": {"video": (clip(frames, 28, 28, 0), {"fps": 0.04})}}
                for frames in (8, 4, 4)]
        problems = [llm.validate([row], SamplingParams(max_tokens=n))[0] for row, n in zip(rows, (16, 400, 16))]
    if version == "2":
        assert problems == [None] * 3
        return
    assert problems[0].startswith("multi_modal_data: the prompt's items reach rotary position ")
    assert "past the model's 512 (max_position_embeddings)" in problems[0]
    assert problems[1].startswith("max_tokens: the prompt's items put its rotary positions ")
    assert problems[2] is None


def test_frame_forms_read_alike_and_hostile_videos_are_the_rows_errors():
    """An array, a list of PIL images and a tuple without a rate are one video; a rate
    changes the hash (Qwen2.5-VL's positions read it). Cut, corrupted and random bytes, odd
    objects and arrays: each is read or refused with a VideoInputError, nothing else."""
    rules = Qwen2VLVideoRules(patch_size=7, merge_size=2, min_pixels=784, max_pixels=2352)
    limits = VideoLimits(min_frames=2, max_frames=16, frame_size=rules.frame_size)
    frames = clip(4, 30, 44, 5)
    forms = [frames, [Image.fromarray(frame) for frame in frames], tuple(frames), (frames, {})]
    read = [read_video(form, limits) for form in forms]
    assert len({video.content_hash for video in read}) == 1 and read[0].frames.shape == (4, 28, 42, 3)
    assert read_video((frames, {"fps": 2}), limits).content_hash != read[0].content_hash
    good = mp4_bytes(clip(12, 32, 48, 1, noise=0), 6)
    rng = np.random.default_rng(0)
    hostile = [None, 3, "", "http://example.com/a.mp4", "data:video/mp4;base64,@@", [1, "a"], (1, 2, 3), (b"", {}),
               [np.zeros((4, 4, 3), np.uint8), np.zeros((5, 4, 3), np.uint8)], np.zeros((2, 1, 1000, 3), np.uint8),
               np.zeros((2, 0, 5, 3), np.uint8), np.zeros((2, 4, 4), np.uint8), (frames, {"fps": float("nan")}),
               good[: len(good) // 2], good[:200], rng.bytes(5000), b"\0" * 1000, mp4_bytes(clip(1, 32, 48, 1), 6)]
    for _ in range(40):
        corrupted = bytearray(good)
        for position in rng.integers(0, len(good), rng.integers(1, 30)):
            corrupted[position] = rng.integers(0, 256)
        hostile.append(bytes(corrupted))
    refused = 0
    for value in hostile:
        try:
            video = read_video(value, limits)
        except VideoInputError:
            refused += 1
        else:
            assert video.frames.dtype == np.uint8 and len(video.frames) >= 2
    assert refused >= 18  # every one before the corrupted files
