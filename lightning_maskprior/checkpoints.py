"""Whether a checkpoint fits a model: its parameter shapes read back as the options that made them, so a mismatch
is reported in the config's terms ("trained with dim 16, the config asks for dim 32")."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_maskprior.attention import PRIOR_PARAMETER_NAMES, PRIOR_PARAMETERS
from lightning_maskprior.priors import Structure

STRUCTURE_KEY = "maskprior_structure"  # a checkpoint's entry for the structure its model trained with


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that was trained with another model than the config builds."""


# The options of our backbones, read from parameter shapes (TokenTransformer, GPT, timm's ViT under ``model.``).
_OPTIONS: list[tuple[str, str, Any]] = [
    ("dim", r"(^|\.)blocks\.0\.norm1\.weight$", lambda s: s[0]),
    ("sequence length", r"(^|\.)pos_embed(ding)?$", lambda s: s[1] if len(s) == 3 else s[0]),
    ("attention width", r"(^|\.)blocks\.0\.attn\.qkv\.weight$", lambda s: f"{s[0] // 3} (num_heads x head_dim)"),
    ("prior shape", r"(^|\.)blocks\.0\.attn\.prior_logits$", tuple),
    ("relative prior shape", r"(^|\.)blocks\.0\.attn\.prior_offsets$", tuple),
    ("low-rank prior shape", r"(^|\.)blocks\.0\.attn\.prior_left$", tuple),
    ("mlp width", r"(^|\.)blocks\.0\.mlp\.(0|fc1)\.weight$", lambda s: s[0]),
    ("vocabulary size", r"(^|\.)token_embedding\.weight$", lambda s: s[0]),
    ("outputs", r"(^|\.)head\.weight$", lambda s: s[0]),
]


def _options(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    blocks = {m.group(2) for key in shapes if (m := re.search(r"(^|\.)blocks\.(\d+)\.", key))}
    if blocks:
        found["depth"] = len(blocks)
    for name, pattern, read in _OPTIONS:
        key = next((k for k in sorted(shapes) if re.search(pattern, k)), None)
        if key is not None and shapes[key]:
            found[name] = read(shapes[key])
    return found


def _is_prior(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in PRIOR_PARAMETER_NAMES


def _parameterisation(keys: Iterator[str]) -> str | None:
    """How the prior of a state dict is held (``full``, ``relative``, ``low_rank``), read from its parameter names;
    None where it has no prior."""
    names = {key.rsplit(".", 1)[-1] for key in keys}
    return next((kind for kind, held in PRIOR_PARAMETERS.items() if names & set(held)), None)


def checkpoint_mismatch(checkpoint: Mapping[str, Any], model: nn.Module, strict: bool = True) -> str | None:
    """What differs between the model a checkpoint was trained with and ``model``, or None if it fits."""
    state = checkpoint.get("state_dict") or {}
    saved = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    differ = sorted(k for k in saved.keys() & ours.keys() if saved[k] != ours[k])
    missing = sorted(ours.keys() - saved.keys()) if strict else []
    unexpected = sorted(saved.keys() - ours.keys()) if strict else []
    if not (differ or missing or unexpected):
        return None
    parts = []
    then, now = _options(saved), _options(ours)
    options = [name for name in then if name in now and then[name] != now[name]]
    if options:
        parts.append(
            f"was trained with {_join(f'{n} {then[n]}' for n in options)}, the config asks for "
            f"{_join(f'{n} {now[n]}' for n in options)}"
        )
    elif differ:
        shown = "; ".join(f"{k} is {saved[k]} in the checkpoint, {ours[k]} in the model" for k in differ[:3])
        parts.append(f"does not fit the model the config builds: {shown}")
    init_then = (checkpoint.get("hyper_parameters") or {}).get("init")
    init_now = getattr(model, "hparams", {}).get("init")
    priors_differ = any(_is_prior(k) for k in missing + unexpected)
    held_then, held_now = _parameterisation(saved), _parameterisation(ours)
    if priors_differ and held_then is not None and held_now is not None and held_then != held_now:
        parts.append(f"holds its prior as parameterisation {held_then!r}, the config asks for {held_now!r}")
    elif priors_differ and init_then is not None and init_then != init_now:
        has = "has" if any(_is_prior(k) for k in unexpected) else "has no"
        parts.append(f"{has} a prior (trained with init {init_then!r}), the config asks for init {init_now!r}")
    elif not options and (missing or unexpected):
        if missing:
            parts.append(f"lacks parameters the model has: {missing[:3]}")
        if unexpected:
            parts.append(f"has parameters the model does not: {unexpected[:3]}")
    return "; ".join(parts)


def _join(items: Iterator[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def non_finite_priors(checkpoint: Mapping[str, Any]) -> str | None:
    """The prior parameters of a checkpoint (M, or what holds it in another parameterisation) that hold NaN or
    infinite values, as ``key (n NaN, m inf)``, or None."""
    found = []
    for key, value in (checkpoint.get("state_dict") or {}).items():
        if _is_prior(key) and isinstance(value, torch.Tensor) and value.is_floating_point():
            nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
            if nan or inf:
                found.append(f"{key} ({nan} NaN, {inf} infinite)")
    return "; ".join(found[:3]) if found else None


def check_checkpoint_fits(checkpoint: Mapping[str, Any], model: nn.Module, path: str | Path | None = None) -> None:
    """Raise a CheckpointError saying, in the config's terms, why ``checkpoint`` does not fit ``model``, or that its
    prior is not finite (it would train on as NaN, and the divergence be blamed on the learning rate)."""
    name = f"checkpoint {path}" if path is not None else "the checkpoint"
    problem = checkpoint_mismatch(checkpoint, model, strict=getattr(model, "strict_loading", True))
    if problem is not None:
        raise CheckpointError(f"{name} {problem}")
    bad = non_finite_priors(checkpoint)
    if bad is not None:
        raise CheckpointError(f"{name} holds a prior that is not finite: {bad}; expected finite prior logits (the file "
                              "was edited, or saved from a diverged run): use an earlier checkpoint")


# ------------------------------------------------------------------------------- the trained structure
def structure_state(structure: Structure) -> dict[str, Any]:
    """``structure`` as tensors and plain values, for a checkpoint (loaded with ``weights_only=True``)."""
    return {"open": structure.open, "name": structure.name, "values": structure.values}


def structure_from_state(state: Mapping[str, Any]) -> Structure:
    """The Structure a checkpoint recorded (:func:`structure_state`); a CheckpointError if it is not one."""
    try:
        return Structure(state["open"], name=str(state.get("name", "structure")), values=state.get("values"))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"the checkpoint's {STRUCTURE_KEY} is not a structure ({err}); expected the one its "
                              "fit saved") from None


def same_structure(a: Structure, b: Structure) -> bool:
    """Whether two structures open the same pairs with the same values."""
    if a.open.shape != b.open.shape or not torch.equal(a.open, b.open):
        return False
    if (a.values is None) != (b.values is None):
        return False
    return a.values is None or (a.values.shape == b.values.shape and torch.equal(a.values, b.values))


# ----------------------------------------------------------------------------------- weights files
def check_weights_file(path: str | Path, option: str) -> None:
    """Raise a CheckpointError naming ``option`` and the file where a weights file (``.safetensors``, or a zip archive
    as ``torch.save`` writes it) is incomplete: cut short, or empty. Nothing is loaded; another kind of file is not
    checked here."""
    import json
    import zipfile

    path = Path(path)
    size = path.stat().st_size

    def incomplete(why: str) -> CheckpointError:
        return CheckpointError(f"{option} {path} is incomplete: {why}; expected the whole file as it was saved "
                               "(copy or save it again)")

    if size == 0:
        raise incomplete("the file is empty")
    with open(path, "rb") as file:
        head = file.read(8)
        if path.suffix == ".safetensors":
            if len(head) < 8:
                raise incomplete(f"{size} bytes, shorter than a safetensors header")
            length = int.from_bytes(head, "little")
            if 8 + length > size:
                raise incomplete(f"{size} bytes, cut short inside its {8 + length}-byte header")
            try:
                header = json.loads(file.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise incomplete("its safetensors header is not readable") from None
            end = max((int(t["data_offsets"][1]) for k, t in header.items()
                       if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t), default=0)
            if 8 + length + end > size:
                raise incomplete(f"{size} of the {8 + length + end} bytes its header describes")
        elif head[:2] == b"PK" and not zipfile.is_zipfile(path):
            raise incomplete(f"{size} bytes, not a complete zip archive (torch.save writes one)")


def check_weights_directory(path: str | Path, option: str) -> None:
    """:func:`check_weights_file` for each weights file of a ``save_pretrained`` directory (``*.safetensors``,
    ``*.bin``)."""
    for file in sorted(Path(path).iterdir()):
        if file.is_file() and file.suffix in (".safetensors", ".bin"):
            check_weights_file(file, option)
