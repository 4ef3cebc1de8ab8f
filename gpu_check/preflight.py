"""`gpu-check preflight`: is this machine ready for the run? Nothing is trained or written.

Checked in order, each an item with its own message: the `[verl]` extra and its versions,
the device, host and device memory, free disk, the run label, the model assets; then, on
the CPU, the parts of the run that can fail for reasons other than the environment: the
tokenizer round-trips the prompts and ends targets with EOS, verl's supervised loss equals
an independent computation, it scores exactly the response tokens (EOS included, prompt
never), and LoRA initialisation after seed 42 reproduces (B starts at zero).

Exit codes (cli.exitcodes): 0 ready; 4 when the ONLY problem is missing model weights;
otherwise 3 for the environment (extra, versions, device, memory, disk), 2 for inputs
(label, model folder), 1 when a CPU check of the run's logic fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.gpu_check import extra, tasks
from rollout_lifecycle.gpu_check.errors import GpuCheckError, ModelAssetsError
from rollout_lifecycle.gpu_check.evidence import EvidenceError, check_label, result_path
from rollout_lifecycle.gpu_check.hashing import tensors_sha256
from rollout_lifecycle.gpu_check.model_assets import (
    ModelAssets,
    build_small_model,
    inspect_model_dir,
)

OK, FAIL, WEIGHTS, SKIP = "ok", "fail", "weights_missing", "skipped"
GIB = 1 << 30

# exit code per kind of failing item (see module docstring)
_KIND_CODE = {"environment": 3, "input": 2, "logic": 1}


@attrs.frozen
class Item:
    """One preflight item: status ok / fail / weights_missing / skipped, and why."""

    name: str
    kind: str  # environment | input | logic
    status: str
    detail: str

    def to_json(self) -> dict[str, str]:
        """As printed with --json."""
        return attrs.asdict(self)


@attrs.frozen
class PreflightReport:
    """All items and the exit code they add up to."""

    items: tuple[Item, ...]
    versions: dict[str, str | None]

    @property
    def exit_code(self) -> int:
        """0 ready, 4 only weights missing, else the most serious failing kind's code."""
        failing = [_KIND_CODE[i.kind] for i in self.items if i.status == FAIL]
        if failing:  # the environment first, then inputs, then the run's logic
            return max(failing)
        if any(i.status == WEIGHTS for i in self.items):
            return 4
        return 0

    def to_json(self) -> dict[str, Any]:
        """As printed with --json."""
        return {
            "ready": self.exit_code == 0,
            "exit_code": self.exit_code,
            "items": [i.to_json() for i in self.items],
            "versions": self.versions,
        }


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _versions_item(v: dict[str, str | None]) -> Item:
    problems = []
    verl_v = v.get("verl") or ""
    if not verl_v.startswith("0.9."):
        problems.append(f"verl {verl_v or 'missing'} (the check is written against 0.9.1)")
    tf = v.get("transformers") or ""
    if tf == "5.6.0" or not tf.startswith("5."):
        problems.append(
            f"transformers {tf or 'missing'} (verl 0.9.1 wants >=5.5.3,<5.11, not 5.6.0)"
        )
    td = v.get("tensordict") or ""
    if td.startswith("0.9.0") or not td.startswith(("0.8", "0.9", "0.10")):
        problems.append(f"tensordict {td or 'missing'} (verl 0.9.1 wants >=0.8,<=0.10, not 0.9.0)")
    shown = ", ".join(
        f"{k} {v.get(k)}" for k in ("verl", "torch", "transformers", "peft", "tensordict")
    )
    return Item("versions", "environment", FAIL if problems else OK, "; ".join(problems) or shown)


def _model_item(model: Path | None) -> tuple[Item, ModelAssets | None, bool]:
    """(item, assets if usable, whether only the weights are missing)."""
    if model is None:
        return (
            Item(
                "model_assets",
                "input",
                OK,
                "no --model: the small Qwen2 model is built here (seed 42)",
            ),
            None,
            False,
        )
    try:
        assets = inspect_model_dir(model)
    except ModelAssetsError as exc:
        status = WEIGHTS if exc.only_weights_missing else FAIL
        return Item("model_assets", "input", status, str(exc)), None, exc.only_weights_missing
    gib = assets.weight_bytes / GIB
    return (
        Item(
            "model_assets",
            "input",
            OK,
            f"{assets.model_type} {list(assets.architectures)}, {len(assets.weight_files)} weight "
            f"file(s), {gib:.2f} GiB, tokenizer {list(assets.tokenizer_files)}",
        ),
        assets,
        False,
    )


def _memory_items(device: str, weight_bytes: int | None) -> list[Item]:
    """Host (and device) memory against a rough need: two fp32 copies plus headroom."""
    fp32 = 2 * (weight_bytes or 0)  # weights on disk are often bf16: fp32 doubles them
    need_device = 2 * fp32 + 2 * GIB
    need_host = (2 * fp32 if device == "cpu" else fp32) + 3 * GIB
    items = []
    avail = _mem_available()
    if avail is None:
        items.append(
            Item("host_memory", "environment", OK, "unknown (no /proc/meminfo); not checked")
        )
    else:
        items.append(
            Item(
                "host_memory",
                "environment",
                OK if avail >= need_host else FAIL,
                f"{avail / GIB:.1f} GiB available, about {need_host / GIB:.1f} GiB needed",
            )
        )
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(0)
        items.append(
            Item(
                "device_memory",
                "environment",
                OK if free >= need_device else FAIL,
                f"{torch.cuda.get_device_name(0)}: {free / GIB:.1f} of {total / GIB:.1f} GiB free, "
                f"about {need_device / GIB:.1f} GiB needed",
            )
        )
    else:
        items.append(Item("device_memory", "environment", SKIP, "cpu run: no device memory"))
    return items


@contextlib.contextmanager
def _small_model_dir() -> Iterator[Path]:
    tmp = tempfile.mkdtemp(prefix="gpu-check-preflight-")
    try:
        build_small_model(Path(tmp))
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_check(tok: Any) -> Item:
    problems = []
    if tok.eos_token_id is None:
        problems.append("no eos_token_id")
    for q in (*tasks.SUPERVISED, *tasks.FROZEN, tasks.FIXED_PROMPT):
        text = tasks.prompt_text(tok, q)
        ids = tasks.encode(tok, text)
        if not ids:
            problems.append(f"{q.expression}: encodes to nothing")
            continue
        back = tok.decode(ids)
        if q.expression not in back.replace(" ", ""):
            problems.append(f"{q.expression}: decodes to {back!r}")
    for q in tasks.SUPERVISED:
        resp = tasks.supervised_response_ids(tok, q)
        if tasks.decode(tok, resp[:-1]).strip() != str(q.answer):
            problems.append(f"answer {q.answer} does not round-trip")
    return Item(
        "tokenizer",
        "logic",
        FAIL if problems else OK,
        "; ".join(problems[:4])
        or f"{len(tasks.SUPERVISED) + len(tasks.FROZEN) + 1} prompts round-trip; targets end with "
        f"EOS id {tok.eos_token_id}",
    )


def _lora(model_dir: Path, seed: int) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32
    )
    torch.manual_seed(seed)
    cfg = LoraConfig(
        task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], bias="none"
    )
    return get_peft_model(base, cfg).eval()


def _adapter(model: Any) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def _loss_checks(model: Any, tok: Any) -> list[Item]:
    """verl's sft_loss vs an independent mean NLL; and exactly which positions it scores."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.torch_functional import logprobs_from_logits
    from verl.workers.utils.losses import sft_loss

    from rollout_lifecycle.gpu_check.verl_driver import sft_batch

    prompts = [tasks.prompt_ids(tok, q) for q in tasks.SUPERVISED]
    responses = [tasks.supervised_response_ids(tok, q) for q in tasks.SUPERVISED]
    td = sft_batch(prompts, responses)
    lps, expected_scored, nll, n = [], [], 0.0, 0
    offset = 0
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            ids = torch.tensor([*p, *r])
            logits = model(input_ids=ids[None]).logits[0].float()
            lps.append(logprobs_from_logits(logits, torch.roll(ids, -1)))
            logp = torch.log_softmax(logits, -1)
            for t in range(len(p), len(p) + len(r)):  # predicting token t from position t-1
                nll -= float(logp[t - 1, ids[t]])
                n += 1
                expected_scored.append(offset + t - 1)
            offset += len(ids)
    values = torch.cat(lps).clone().requires_grad_(True)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=td["input_ids"].offsets())
    tu.assign_non_tensor(
        td, dp_size=1, batch_num_tokens=int(td["loss_mask"].values().sum()), pad_mode="no_padding"
    )
    loss, _ = sft_loss(None, {"log_probs": nested}, td)
    loss.backward()
    independent = nll / n
    value = float(loss.detach())
    diff = abs(value - independent)
    grad = values.grad
    assert grad is not None
    scored = torch.nonzero(grad != 0).flatten().tolist()
    eos_last = all(r[-1] == tok.eos_token_id for r in responses)
    return [
        Item(
            "loss",
            "logic",
            OK if diff <= 1e-5 else FAIL,
            f"verl sft_loss {value:.6f} vs independent mean NLL {independent:.6f} "
            f"(|diff| {diff:.2e})",
        ),
        Item(
            "scored_positions",
            "logic",
            OK if scored == expected_scored and eos_last else FAIL,
            f"{len(scored)} positions scored, exactly those predicting the {n} response tokens "
            "(EOS included, prompt tokens never)"
            if scored == expected_scored and eos_last
            else f"scored {scored[:8]}..., expected {expected_scored[:8]}...",
        ),
    ]


def _init_check(model_dir: Path, small: bool) -> Item:
    a1 = _adapter(_lora(model_dir, 42))
    a2 = _adapter(_lora(model_dir, 42))
    h1, h2 = tensors_sha256(a1), tensors_sha256(a2)
    b_zero = all(float(t.abs().max()) == 0.0 for n, t in a1.items() if ".lora_B." in n)
    a_nonzero = all(float(t.abs().max()) > 0.0 for n, t in a1.items() if ".lora_A." in n)
    note = ""
    ok = h1 == h2 and b_zero and a_nonzero
    if small:
        with tempfile.TemporaryDirectory(prefix="gpu-check-rebuild-") as d:
            build_small_model(Path(d))
            from safetensors.torch import load_file

            w1 = load_file(str(model_dir / "model.safetensors"))
            w2 = load_file(str(Path(d) / "model.safetensors"))
            same = tensors_sha256(w1) == tensors_sha256(w2)
        ok = ok and same
        note = f"; the small model rebuilt after seed 42 is {'identical' if same else 'DIFFERENT'}"
    return Item(
        "init_reproducible",
        "logic",
        OK if ok else FAIL,
        f"LoRA after seed 42 twice: {h1[:12]} / {h2[:12]}; lora_B all zero: {b_zero}; "
        f"lora_A non-zero: {a_nonzero}{note}",
    )


def run_preflight(
    *,
    run_label: str,
    output_root: Path,
    model: Path | None,
    device: str,
    progress: Callable[[str], None] | None = None,
) -> PreflightReport:
    """Every preflight item, in order; nothing is written except temporary files."""
    say = progress or (lambda _m: None)
    items: list[Item] = []
    versions = extra.versions()
    missing = extra.missing_modules()
    if missing:
        items.append(
            Item(
                "extra",
                "environment",
                FAIL,
                f"not importable: {', '.join(missing)}; install with: {extra.INSTALL_HINT}",
            )
        )
    else:
        items.append(Item("extra", "environment", OK, "verl and its worker-path modules import"))
        items.append(_versions_item(versions))
    try:
        check_label(run_label)
        final = result_path(output_root, run_label)
        if final.exists() or (final.parent / run_label).exists():
            raise EvidenceError(f"{final} (or its run folder) exists; a new run needs a new label")
        parent = next((p for p in (final.parent, *final.parent.parents) if p.exists()), None)
        if parent is None or not os.access(parent, os.W_OK):
            raise EvidenceError(f"cannot create or write {final.parent}")
        free = shutil.disk_usage(parent).free
        items.append(Item("run_label", "input", OK, f"{final} is free"))
        items.append(
            Item(
                "disk",
                "environment",
                OK if free >= GIB // 2 else FAIL,
                f"{free / GIB:.1f} GiB free under {parent}",
            )
        )
    except EvidenceError as exc:
        items.append(Item("run_label", "input", FAIL, str(exc)))
    model_item, assets, weights_missing = _model_item(model)
    items.append(model_item)
    if missing:
        items += [
            Item(n, "logic", SKIP, "needs the [verl] extra")
            for n in ("device", "tokenizer", "loss", "scored_positions", "init_reproducible")
        ]
        return PreflightReport(tuple(items), versions)

    from rollout_lifecycle.gpu_check import platform

    try:
        info = platform.prepare(device)
        items.append(
            Item(
                "device",
                "environment",
                OK,
                f"{info.device} ({info.name}), verl platform {info.platform}, {info.backend}",
            )
        )
        import verl.workers.engine_workers  # noqa: F401  (uvicorn/fastapi, the engine registry)
    except (GpuCheckError, ImportError, RuntimeError) as exc:
        items.append(Item("device", "environment", FAIL, str(exc)))
        return PreflightReport(tuple(items), versions)
    items += _memory_items(info.device, assets.weight_bytes if assets else None)
    if model is None:
        model_dir: contextlib.AbstractContextManager[Path] = _small_model_dir()
    elif assets is not None or weights_missing:
        model_dir = contextlib.nullcontext(Path(model))
    else:
        return PreflightReport(tuple(items), versions)
    from transformers import AutoTokenizer

    with model_dir as mdir:
        say("preflight: tokenizer")
        tok = AutoTokenizer.from_pretrained(str(mdir))
        items.append(_tokenizer_check(tok))
        if weights_missing:
            items += [
                Item(n, "logic", SKIP, "needs the model weights")
                for n in ("loss", "scored_positions", "init_reproducible")
            ]
            return PreflightReport(tuple(items), versions)
        say("preflight: verl's loss and scored positions on the CPU")
        items += _loss_checks(_lora(mdir, 42), tok)
        say("preflight: initialisation reproduces")
        items.append(_init_check(mdir, small=model is None))
    return PreflightReport(tuple(items), versions)
