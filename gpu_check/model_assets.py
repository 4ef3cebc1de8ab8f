"""The model a run trains: a local folder the user names, or a small one built here.

No model hub is contacted, ever. `inspect_model_dir` says precisely what a local folder
lacks, and tells "only the weights are missing" apart from everything else (preflight
exits 4 for that one case). `build_small_model` writes a Qwen2-architecture model with
random weights (seed 42) and a local word-level tokenizer for arithmetic, so the same
worker path runs on a CPU in seconds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.gpu_check.errors import ModelAssetsError
from rollout_lifecycle.model.atomic import atomic_write

SMALL_MODEL_SEED = 42
# the probe's tiny Qwen2 (VERL-0.9.1.md section 1): 2 layers x {q,v} x {A,B} = 8 LoRA tensors
SMALL_MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "max_position_embeddings": 256,
}
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
SYMBOLS = ("+", "-", "*", "=", "?", " ")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_LFS_HEAD = b"version https://git-lfs"


@attrs.frozen
class ModelAssets:
    """What a usable model folder holds."""

    path: Path
    model_type: str
    architectures: tuple[str, ...]
    weight_files: tuple[str, ...]
    weight_bytes: int
    tokenizer_files: tuple[str, ...]
    built_here: bool = False

    def to_json(self) -> dict[str, Any]:
        """For the evidence's `model` section."""
        return {
            "path": str(self.path),
            "model_type": self.model_type,
            "architectures": list(self.architectures),
            "weight_files": list(self.weight_files),
            "weight_bytes": self.weight_bytes,
            "tokenizer_files": list(self.tokenizer_files),
            "built_here": self.built_here,
        }


def _is_lfs_pointer(p: Path) -> bool:
    try:
        with p.open("rb") as fh:
            return fh.read(len(_LFS_HEAD)) == _LFS_HEAD
    except OSError:
        return True


def _weights(path: Path) -> tuple[list[str], list[str]]:
    """(present weight files, missing ones): safetensors only, sharded or not."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ModelAssetsError(f"{index}: unreadable weight index ({exc})") from None
        present = [s for s in shards if (path / s).is_file() and not _is_lfs_pointer(path / s)]
        return present, [s for s in shards if s not in present]
    single = path / "model.safetensors"
    if single.is_file() and not _is_lfs_pointer(single):
        return ["model.safetensors"], []
    return [], ["model.safetensors (or model.safetensors.index.json and its shards)"]


def inspect_model_dir(path: Path) -> ModelAssets:
    """Check a local model folder; ModelAssetsError says what is missing (and if only weights)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelAssetsError(
            f"--model {path}: not a directory; give the local folder of the model "
            "(config.json, tokenizer files, *.safetensors); no model hub is contacted"
        )
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelAssetsError(f"--model {path}: config.json is missing")
    try:
        cfg = json.loads(cfg_path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelAssetsError(f"{cfg_path}: not readable JSON ({exc})") from None
    archs = tuple(cfg.get("architectures") or ())
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelAssetsError(
            f"{cfg_path}: architectures {list(archs)} has no *ForCausalLM; the check trains a "
            "causal LM with LoRA on q_proj/v_proj (e.g. Qwen2.5-0.5B-Instruct)"
        )
    toks = tuple(n for n in TOKENIZER_FILES if (path / n).is_file())
    if not toks:
        raise ModelAssetsError(
            f"--model {path}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    if any((path / n).is_file() for n in ("pytorch_model.bin", "model.bin")) and not (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    ):
        raise ModelAssetsError(
            f"--model {path}: only pickle weights (*.bin) found; this check loads safetensors "
            "only (convert them, e.g. with transformers' save_pretrained(safe_serialization=True))"
        )
    present, missing = _weights(path)
    if missing:
        raise ModelAssetsError(
            f"--model {path}: only the model weights are missing ({', '.join(missing)}); "
            "config and tokenizer are there. Copy the weights in (on a machine with network: "
            "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir PATH)",
            only_weights_missing=True,
        )
    size = sum((path / f).stat().st_size for f in present)
    return ModelAssets(
        path=path,
        model_type=str(cfg.get("model_type", "?")),
        architectures=archs,
        weight_files=tuple(present),
        weight_bytes=size,
        tokenizer_files=toks,
    )


def small_tokenizer() -> Any:
    """A word-level tokenizer for arithmetic: specials, symbols, then the integers 0..990."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n_numbers = SMALL_MODEL_CONFIG["vocab_size"] - len(SPECIAL_TOKENS) - len(SYMBOLS)
    words = [*SPECIAL_TOKENS, *SYMBOLS, *(str(i) for i in range(n_numbers))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.Punctuation("isolated")]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_small_model(path: Path) -> ModelAssets:
    """Write the small Qwen2 model (random weights after seed 42) and its tokenizer to `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = small_tokenizer()
    tok.save_pretrained(str(path))
    cfg = Qwen2Config(
        **SMALL_MODEL_CONFIG,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(SMALL_MODEL_SEED)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(path), safe_serialization=True)
    atomic_write(
        path / "BUILT_BY.json",
        json.dumps(
            {"by": "rollout-lifecycle gpu-check", "seed": SMALL_MODEL_SEED, **SMALL_MODEL_CONFIG},
            indent=2,
            sort_keys=True,
        )
        + "\n",
    )
    return attrs.evolve(inspect_model_dir(path), built_here=True)


def tokenizer_id(path: Path) -> str:
    """Identity of a tokenizer for the generation conditions: sha256 of its files."""
    h = hashlib.sha256()
    for name in (*TOKENIZER_FILES, "tokenizer_config.json", "merges.txt"):
        p = Path(path) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return "sha256:" + h.hexdigest()[:16]
