"""Writing what a model made back next to the data it came from: predictions and generated samples.

A segmentation prediction of a NIfTI image is written as NIfTI with that image's affine and header, so it
opens over the original in a clinical viewer; a PNG image's as PNG. A classification prediction is a row
of ``predictions.csv``. Generated images are NIfTI with the conditioning label map's affine.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Mapping

import nibabel as nib
import numpy as np
import torch

from medflare import ConfigError
from medflare.common.training import make_loader
from medflare.data.loaders import read_datalist
from medflare.metrics import logits_to_label_map

NIFTI_SUFFIXES = (".nii", ".nii.gz")


def _stem(path: str) -> str:
    name = Path(path).name
    for suffix in (*NIFTI_SUFFIXES, ".png", ".jpg", ".jpeg"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem


def save_like(array: np.ndarray, reference: str, out: Path) -> Path:
    """Write a 2D/3D ``array`` as NIfTI with ``reference``'s affine and header (PNG if the reference is not NIfTI)."""
    if str(reference).lower().endswith(NIFTI_SUFFIXES):
        ref = nib.load(reference)
        header = ref.header.copy()
        header.set_data_dtype(array.dtype)
        path = out.with_name(out.name + ".nii.gz")
        nib.save(nib.Nifti1Image(array, ref.affine, header), path)
        return path
    from PIL import Image

    path = out.with_name(out.name + ".png")
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path)
    return path


@torch.no_grad()
def write_predictions(predictor, data_cfg: Mapping[str, Any], args, device) -> list[Path]:
    """Predict every image of ``args.datalist`` / ``args.npz`` (split ``args.split``) into folder ``args.out``."""
    from medflare.data import load_npz_split, load_seg_split
    from medflare.metrics import to_class_labels

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    num_classes = int(data_cfg["num_classes"])
    if isinstance(predictor, torch.nn.Module):
        predictor.eval()
    if args.npz:
        dataset = load_npz_split(args.npz, args.split, num_classes=num_classes)
        path = out / "predictions.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["name", "prediction", "label"])
            for batch in make_loader(dataset, args.batch_size, False):
                pred = to_class_labels(predictor(batch["image"].to(device))).cpu().tolist()
                writer.writerows(zip(batch["name"], pred, batch["label"].tolist()))
        return [path]
    entries = read_datalist(args.datalist, args.split)
    dataset = load_seg_split(args.datalist, args.split, num_classes=num_classes, cache=False)
    written, i = [], 0
    for batch in make_loader(dataset, args.batch_size, False):
        labels = logits_to_label_map(predictor(batch["image"].to(device)), num_classes).cpu().numpy().astype(np.uint8)
        for label_map in labels:
            image_file = entries[i]["image"]
            written.append(save_like(label_map[0], image_file, out / f"{_stem(image_file)}_pred"))
            i += 1
    return written


def write_samples(result, options: Mapping[str, Any], args, device) -> list[Path]:
    """Generate with ``result.sample`` from the label maps of ``args.labels`` (or ``args.num`` unconditioned) into ``args.out``."""
    from medflare.data import load_seg_split

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = {**options, "num": args.num, "seed": args.seed}
    if not args.labels:
        images = result.sample([], options)
        written = []
        for i, image in enumerate(images):
            path = out / f"sample_{i:04d}.nii.gz"
            nib.save(nib.Nifti1Image(image.cpu().numpy().squeeze(0).astype(np.float32), np.eye(4)), path)
            written.append(path)
        return written
    num_classes = int(result.description["data"]["num_classes"])
    entries = read_datalist(args.labels, args.split)
    dataset = load_seg_split(args.labels, args.split, num_classes=num_classes, cache=False)
    label_maps = [dataset[i]["label"].to(device) for i in range(len(dataset))]
    images = result.sample(label_maps, options)
    if len(images) != len(label_maps):
        raise ConfigError(f"kind '{result.kind}' returned {len(images)} samples for {len(label_maps)} label maps")
    return [
        save_like(image.cpu().numpy().squeeze(0).astype(np.float32), entry["label"], out / f"{_stem(entry['label'])}_synthetic")
        for image, entry in zip(images, entries)
    ]
