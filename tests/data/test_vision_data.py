"""Image rows (verl's `images` column + `<image>` placeholders): the same ids and pixels as HF's Qwen2.5-VL
processor, errors that name the row, and the built-in `colour_count` task and its scorer."""

from __future__ import annotations

import io
import random
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin

from hybridflow.data import collate_rl
from hybridflow.data.colour_task import CELL, COLOURS, GRID
from hybridflow.data.parquet_io import read_rows, write_rows
from hybridflow.data.rl_dataset import RLHFDataset
from hybridflow.data.tasks import get_task, task_splits
from hybridflow.data.vision import IMAGE_GRID_THW, PIXEL_VALUES, VISION_END, VISION_START
from hybridflow.models.tiny_vl import tiny_vl_image_processor, tiny_vl_tokenizer
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import keys
from hybridflow.rewards.registry import get_reward_fn, reward_fn_name


def _png(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _row(prompt, images, truth="1"):
    return {"prompt": prompt, "images": images, "reward_model": {"ground_truth": truth}}


def _dataset(rows, **kw):
    return RLHFDataset(rows, tiny_vl_tokenizer(), max_prompt_length=96, image_processor=tiny_vl_image_processor(),
                       **kw)


def test_ids_and_pixels_equal_the_hf_processor():
    images = [_png(32, 24, 0), _png(16, 32, 1)]
    item = _dataset([_row([{"role": "user", "content": "A <image> and <image>?"}], [{"bytes": b} for b in images])])[0]
    # the HF processor on the same rendered prompt (its class check wants a video processor: torchvision)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        proc = Qwen2_5_VLProcessor(image_processor=tiny_vl_image_processor(), tokenizer=tiny_vl_tokenizer(),
                                   video_processor=None)
    text = "User: A " + VISION_START + "<|image_pad|>" + VISION_END + " and " + VISION_START + "<|image_pad|>" \
        + VISION_END + "?\nAssistant:"
    ref = proc(text=[text], images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
    assert item[keys.INPUT_IDS].tolist() == ref["input_ids"][0].tolist()
    mm = item[keys.MULTI_MODAL_INPUTS]
    torch.testing.assert_close(mm[PIXEL_VALUES], ref[PIXEL_VALUES])
    assert mm[IMAGE_GRID_THW].tolist() == ref[IMAGE_GRID_THW].tolist()


def test_collate_keeps_each_rows_images_with_it():
    rows = [_row("<image>a", [{"bytes": _png(32, 32, 0)}]), _row("<image>bb", [{"bytes": _png(16, 16, 1)}])]
    ds = _dataset(rows)
    batch = collate_rl([ds[0], ds[1]], pad_token_id=0)
    batch.reorder(torch.tensor([1, 0]))
    assert batch.non_tensor_batch[keys.MULTI_MODAL_INPUTS][0][IMAGE_GRID_THW].tolist() == [[1, 4, 4]]
    assert batch.non_tensor_batch[keys.MULTI_MODAL_INPUTS][1][IMAGE_GRID_THW].tolist() == [[1, 8, 8]]


@pytest.mark.parametrize("prompt, images, why", [
    ("<image> and <image>", [{"bytes": b"x"}], "2 <image> placeholder\\(s\\) but the row has 1 image"),
    ("<image>?", None, "1 <image> placeholder\\(s\\) but the row has 0 image"),
    ("no image", [{"bytes": b"png"}], "0 <image> placeholder\\(s\\) but the row has 1 image"),
    ("<image>?", [{"bytes": b"not a png"}], "images\\[0\\] is not a readable image"),
    ("<image>?", [{"path": "a.png"}], "images\\[0\\] must be image bytes"),
    ("<image>?", [{"bytes": _png(2, 402, 0)}], "images\\[0\\]: the image processor refuses its size"),
])
def test_bad_image_rows_name_the_row(prompt, images, why):
    rows = [_row("<image>fine", [{"bytes": _png(8, 8, 0)}]), _row(prompt, images)]
    with pytest.raises(ValueError, match=f"row 1 is malformed: .*{why}"):
        _dataset(rows, strict=True)
    assert _dataset(rows).skips.counts == {"malformed": 1}  # data.strict=false: skipped and counted


def test_images_for_a_text_only_model_are_refused():
    rows = [_row("<image>?", [{"bytes": _png(8, 8, 0)}])]
    with pytest.raises(ValueError, match="row 0 is malformed: .*takes no images"):
        RLHFDataset(rows, builtin_tokenizer(), max_prompt_length=64, strict=True)


def test_colour_count_rows_draw_the_answer_and_survive_parquet(tmp_path):
    train, _ = task_splits("colour_count", 8, 2, seed=1)
    rows = read_rows(str(write_rows(train, tmp_path / "train.parquet")))
    for row in rows:
        question, truth = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
        colour = next(c for c, (name, _) in COLOURS.items() if f"How many {name}?" in question)
        img = np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))
        centres = img[CELL // 2::CELL, CELL // 2::CELL].reshape(GRID * GRID, 3)
        assert int(truth) == sum(tuple(c) == COLOURS[colour][1] for c in centres)
    item = _dataset(rows)[0]
    assert item[keys.MULTI_MODAL_INPUTS][IMAGE_GRID_THW].tolist() == [[1, 8, 8]]  # 16 image tokens
    score = get_reward_fn(reward_fn_name(rows[0]["data_source"]))
    truth = rows[0]["reward_model"]["ground_truth"]
    assert score("hybridflow/colour_count", f"#### {truth}", truth)["score"] == 1.0
    assert score("hybridflow/colour_count", f"#### {int(truth) + 1}", truth)["score"] == 0.0


def test_sft_image_rows_carry_the_rl_prompt_ids_and_pixels():
    from hybridflow.data.sft_dataset import SFTDataset
    from hybridflow.workers.supervised_batch import collate_sft_rows

    train, _ = task_splits("colour_count", 4, 2, seed=1)
    tok = tiny_vl_tokenizer()
    sft = SFTDataset(train, tok, max_length=96, image_processor=tiny_vl_image_processor())
    rl = _dataset(train)
    for i in range(len(train)):
        item, prompt = sft[i], rl[i]
        n = len(prompt[keys.INPUT_IDS])
        # the prompt as RL renders it (image pads and all), then the trained answer and EOS
        assert item[keys.INPUT_IDS][:n].tolist() == prompt[keys.INPUT_IDS].tolist()
        assert item["loss_mask"][:n].sum() == 0 and item["loss_mask"][n:].all()
        truth = train[i]["reward_model"]["ground_truth"]
        assert tok.decode(item[keys.INPUT_IDS][n:]) == f"#### {truth}{tok.eos_token}"
        for k in (PIXEL_VALUES, IMAGE_GRID_THW):
            assert torch.equal(item[keys.MULTI_MODAL_INPUTS][k], prompt[keys.MULTI_MODAL_INPUTS][k])
    batch = collate_sft_rows([sft[0], sft[1]], tok.pad_token_id)
    column = batch.non_tensor_batch[keys.MULTI_MODAL_INPUTS]
    assert len(column) == 2 and torch.equal(column[1][PIXEL_VALUES], sft[1][keys.MULTI_MODAL_INPUTS][PIXEL_VALUES])
    with pytest.raises(ValueError, match="sft rows carry images but the model takes none"):
        SFTDataset(train, tok, max_length=96)
    with pytest.raises(ValueError, match="the cut would drop image tokens"):
        SFTDataset(train, tok, max_length=12, image_processor=tiny_vl_image_processor())[0]


def test_colour_count_flawed_demonstrations_drop_the_answer_marker():
    train, _ = task_splits("colour_count", 4, 2, seed=1)
    truth = train[0]["reward_model"]["ground_truth"]
    bad = get_task("colour_count").corrupt(train[0], random.Random(0))
    assert bad["response"] == truth and bad["images"] == train[0]["images"]
    scorer = get_reward_fn(reward_fn_name(train[0]["data_source"]))
    assert scorer("hybridflow/colour_count", bad["response"], truth)["score"] == 0.0


def _truncated_png() -> bytes:
    """A PNG whose header reads (the build-time check passes) but whose pixel data is cut short."""
    data = _png(32, 32, 5)
    return data[: len(data) // 2]


def test_an_image_that_does_not_decode_names_the_row_its_file_and_the_column(tmp_path):
    from hybridflow.data.sft_dataset import SFTDataset

    train, _ = task_splits("colour_count", 4, 2, seed=1)
    train[3]["images"] = [{"bytes": _truncated_png()}]
    write_rows(train[:2], tmp_path / "a.parquet")
    write_rows(train[2:], tmp_path / "b.parquet")
    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    rl = RLHFDataset.from_files(files, tiny_vl_tokenizer(), max_prompt_length=96,
                                image_processor=tiny_vl_image_processor())
    sft = SFTDataset.from_files(files, tiny_vl_tokenizer(), max_length=96, image_processor=tiny_vl_image_processor(),
                                name="sft-train")
    assert rl[2][keys.MULTI_MODAL_INPUTS] and sft[2][keys.MULTI_MODAL_INPUTS]  # the other rows load
    where = f"data row 3 \\(file {tmp_path}/b.parquet, its row 1\\): cannot read its images: .*Fix the row's 'images'"
    with pytest.raises(ValueError, match=f"train {where}"):
        rl[3]
    with pytest.raises(ValueError, match=f"sft-train {where}"):
        sft[3]


def test_an_image_size_the_processor_refuses_is_a_malformed_row():
    rows = [_row("<image>fine", [{"bytes": _png(8, 8, 0)}]), _row("<image>?", [{"bytes": _png(402, 2, 1)}])]
    with pytest.raises(ValueError, match="row 1 is malformed: images\\[0\\]: the image processor refuses its size"):
        _dataset(rows, strict=True)
    assert _dataset(rows).skips.counts == {"malformed": 1}


def test_image_tensors_that_do_not_fit_the_row_are_refused_where_it_loads():
    ds = _dataset([_row("<image>a", [{"bytes": _png(16, 16, 0)}])])
    ids, mm = ds[0][keys.INPUT_IDS], ds[0][keys.MULTI_MODAL_INPUTS]
    vision = ds.vision
    vision.check_inputs(mm, ids, "row 0")  # the processor's own output fits
    pixels, grid = mm[PIXEL_VALUES], mm[IMAGE_GRID_THW]
    cases = [
        ({PIXEL_VALUES: pixels[:, :-1], IMAGE_GRID_THW: grid}, ids, "pixel_values is torch.float32 \\(16, 95\\)"),
        ({PIXEL_VALUES: pixels.long(), IMAGE_GRID_THW: grid}, ids, "not floating point"),
        ({PIXEL_VALUES: pixels.numpy(), IMAGE_GRID_THW: grid}, ids, "must hold tensors"),
        ({PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid.float()}, ids, "not positive integer"),
        ({PIXEL_VALUES: pixels[:8], IMAGE_GRID_THW: grid}, ids, "makes 16 patches but pixel_values has 8"),
        (mm, ids[ids != vision.image_token_id], "holds 0 <\\|image_pad\\|> tokens but its images make 4"),
    ]
    for bad, bad_ids, why in cases:
        with pytest.raises(ValueError, match=f"row 0: (column 'multi_modal_inputs'|the prompt)(: )?.*{why}"):
            vision.check_inputs(bad, bad_ids, "row 0")
    # vision tokens typed into a text-only prompt would make a worker's forward fail on its own rank
    text_only = _dataset([_row("Look: <|image_pad|>", None)])
    with pytest.raises(ValueError, match="train data row 0: the prompt holds 1 <\\|image_pad\\|> tokens but the "
                                         "row has no images"):
        text_only[0]


def test_an_image_processor_that_does_not_match_the_vision_tower_is_refused():
    from types import SimpleNamespace

    from hybridflow.models.loader import _check_patches

    vision = SimpleNamespace(patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    _check_patches(SimpleNamespace(patch_size=14, temporal_patch_size=2, merge_size=2), vision, "model.path=m")
    with pytest.raises(ValueError, match="model.path=m: the image processor .*\\(patch_size=16 vs "
                                         "vision_config.patch_size=14\\)"):
        _check_patches(SimpleNamespace(patch_size=16, temporal_patch_size=2, merge_size=2), vision, "model.path=m")
