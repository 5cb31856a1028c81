"""Train the embedded model from scratch and save it as a llava-hf checkpoint.

Steps: train the tokenizer → write the tokenizer and preprocessing files → build
``LlavaForConditionalGeneration`` from :func:`build_config` with ``torch.manual_seed(seed)``
→ stage 1, vision warm-up: the vision tower alone, with throw-away linear heads,
learns per-patch shape, colour and left-to-right rank (:class:`VisionStream`; a
ViT from scratch learns shapes far faster from dense labels than through the LM)
→ stage 2: the whole model on conversations (:class:`TrainingStream`, loss on
answer tokens only; ``grounded=True`` puts the yes/no, colour and count questions
before the caption so that no answer can be copied from a caption in the context) → optional stage 3 (``qa_steps``; grounded questions asked
before the caption, off by default) → ``save_pretrained`` (safetensors, float32)
plus ``generation_config.json`` and ``TRAINING.md``. Every stage uses AdamW with
linear warm-up and cosine decay.

Everything is a function of the seed: the same seed and thread count give the same
weights bit for bit (float reductions may differ across thread counts).
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import (
    CLIPImageProcessorPil,
    GenerationConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

from mm_serve.shapes.dataset import (
    IGNORE_INDEX,
    QA_NAMESPACE,
    QUESTION_PROBE_CLASSES,
    ConversationEncoder,
    TrainingStream,
    VisionStream,
)
from mm_serve.shapes.model_config import (
    IMAGE_SIZE,
    PATCH_SIZE,
    ModelSize,
    build_config,
    image_processor_config,
    processor_config,
    sincos_2d,
)
from mm_serve.shapes.scenes import COLOURS, SHAPES
from mm_serve.shapes.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; the defaults trained the shipped checkpoint."""

    seed: int = 0
    vision_steps: int = 1400  # stage 1 optimizer steps
    vision_batch_size: int = 64  # stage 1 scenes per step
    vision_lr: float = 2e-3  # stage 1 peak learning rate
    steps: int = 1000  # stage 2 optimizer steps
    batch_size: int = 32  # stage 2 scenes per step
    lr: float = 1.5e-3  # stage 2 peak learning rate
    patch_loss_weight: float = 0.5  # stages 2-3 weight of the per-patch loss on the projected features
    question_probe_weight: float = 1.0  # stages 2-3 weight of the question-probe loss (0: off)
    question_probe_layer: int = 2  # decoder layer whose output the question probe reads
    grounded: bool = True  # stage 2: yes/no, colour and count questions before the caption (False: one turn per kind, any order)
    caption_first: float = 0.4  # grounded stage 2: probability that the caption is the first turn
    qa_steps: int = 0  # stage 3 optimizer steps (0: no stage 3, as in the shipped checkpoint)
    qa_lr: float = 1.5e-3  # stage 3 peak learning rate
    warmup: int = 50  # linear warm-up steps of each stage
    weight_decay: float = 0.05  # on matrices only
    grad_clip: float = 1.0  # max global grad norm
    threads: int = 0  # torch threads; 0 = torch's default
    bf16: bool = True  # bfloat16 autocast for matmuls (weights and optimizer stay float32)


@dataclass(frozen=True)
class TrainResult:
    """What a run produced: where, how long (s), the stage 2 loss and the stage 1 shape accuracy."""

    out_dir: Path
    seconds: float  # wall clock
    cpu_seconds: float  # CPU time of the process, all threads (wall x threads when the cores are free)
    final_loss: float  # mean loss of the last 50 stage 2 steps
    vision_accuracy: float  # per-patch shape accuracy at the end of stage 1


def prepare_checkpoint_files(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train and save the tokenizer and write the preprocessing configs; returns the loaded tokenizer."""
    save_tokenizer(train_tokenizer(), out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor_config(), indent=2) + "\n")
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config(), indent=2) + "\n")
    return PreTrainedTokenizerFast.from_pretrained(out_dir)


def build_model(tokenizer: PreTrainedTokenizerFast, size: ModelSize | None = None) -> LlavaForConditionalGeneration:
    """A freshly initialised model for ``tokenizer`` (seed torch first for reproducibility).

    The vision tower's learned position embeddings start from a 2D sine-cosine table
    (:func:`sincos_2d`) instead of small noise, so "left of" is visible from step 0.
    """
    ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in SPECIAL_TOKENS}  # type: ignore[arg-type]
    model = LlavaForConditionalGeneration(build_config(len(tokenizer), ids, size))
    table = sincos_2d(IMAGE_SIZE // PATCH_SIZE, (size or ModelSize()).vision_hidden)
    with torch.no_grad():
        model.model.vision_tower.embeddings.position_embedding.weight.copy_(table)
    return model


def _optimizer(
    params: list[torch.nn.Parameter], lr: float, steps: int, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (decay on matrices only) and a warm-up + cosine schedule down to 2 % of ``lr``."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, steps - cfg.warmup)
        return 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _step(loss: torch.Tensor, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: TrainConfig) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    scheduler.step()


_SPLITS = (1 + len(SHAPES), len(COLOURS), 3)  # per-patch logits: shape (+ background), colour, rank


def patch_heads(width: int) -> torch.nn.Linear:
    """A throw-away linear probe from ``width`` features to the per-patch logits (:data:`_SPLITS`)."""
    return torch.nn.Linear(width, sum(_SPLITS))


def patch_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Summed cross-entropy of ``logits`` ``[B, P, 13]`` against ``labels`` ``[B, 3, P]``, and
    the shape accuracy on shape-covered patches."""
    parts = logits.float().split(_SPLITS, dim=-1)
    loss = sum(
        (F.cross_entropy(part.flatten(0, 1), labels[:, i].flatten(), ignore_index=IGNORE_INDEX) for i, part in enumerate(parts)),
        start=torch.zeros(()),
    )
    covered = labels[:, 0] > 0
    accuracy = (parts[0].argmax(-1) == labels[:, 0])[covered].float().mean().item()
    return loss, accuracy


def warm_up_vision(model: LlavaForConditionalGeneration, image_processor: CLIPImageProcessorPil, cfg: TrainConfig) -> float:
    """Stage 1: train the vision tower on per-patch labels; returns the final shape accuracy on
    shape-covered patches (last 20 steps). The linear heads are discarded afterwards."""
    tower = model.model.vision_tower
    grid = IMAGE_SIZE // PATCH_SIZE
    heads = patch_heads(model.model.vision_tower.config.hidden_size)
    params = [*tower.parameters(), *heads.parameters()]
    optimizer, scheduler = _optimizer(params, cfg.vision_lr, cfg.vision_steps, cfg)
    stream = VisionStream(image_processor, grid, cfg.seed, cfg.vision_batch_size)
    accuracy: list[float] = []
    bar = tqdm(range(cfg.vision_steps), desc="stage 1 (vision)", unit="step", dynamic_ncols=True)
    for step in bar:
        pixels, labels = stream.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            hidden = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
            logits = heads(hidden[model.config.vision_feature_layer][:, 1:])
        loss, shape_accuracy = patch_loss(logits, labels)
        _step(loss, params, optimizer, scheduler, cfg)
        accuracy.append(shape_accuracy)
        if step % 25 == 0 or step == cfg.vision_steps - 1:
            tqdm.write(f"vision step {step:5d}  loss {loss.item():.4f}  shape acc {sum(accuracy[-25:]) / len(accuracy[-25:]):.3f}")
    return sum(accuracy[-20:]) / len(accuracy[-20:])


def _write_training_md(cfg: TrainConfig, result: TrainResult, start_stage: int) -> None:
    out_dir, seconds = result.out_dir, result.seconds
    threads = f" --threads {cfg.threads}" if cfg.threads else ""
    threads += f" --start-stage {start_stage}" if start_stage != 1 else ""
    lines = [
        "# Training record",
        "",
        f"Command: `python -m mm_serve.shapes train --out {out_dir} --seed {cfg.seed}{threads}`",
        "",
        f"- seed: {cfg.seed} (scenes from namespaces `train-vision`, `train`, `train-qa`; evaluation uses `heldout`)",
        f"- settings: `{json.dumps(asdict(cfg))}`",
        f"- wall time: {seconds / 60:.1f} min on {torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()};"
        f" CPU time {result.cpu_seconds / 60:.1f} min (all threads)",
        f"- stage 1 per-patch shape accuracy: {result.vision_accuracy:.3f}",
        f"- final LM loss (mean of the last 50 steps of the last stage): {result.final_loss:.4f}",
        f"- torch {torch.__version__}, Python {sys.version.split()[0]}",
        "",
    ]
    (out_dir / "TRAINING.md").write_text("\n".join(lines))


def train_conversations(
    model: LlavaForConditionalGeneration, stream: TrainingStream, steps: int, lr: float, cfg: TrainConfig, name: str
) -> float:
    """Stages 2 and 3: the whole model on conversations; returns the mean LM loss of the last 50 steps.

    The loss is the LM loss on answer tokens plus ``patch_loss_weight`` times the
    per-patch loss of a linear probe on the projected image features (the LM's input),
    which keeps shape, colour and rank linearly readable there, plus (when
    ``question_probe_weight`` > 0) a linear probe on decoder layer
    ``question_probe_layer``'s output at the shape word of each colour and yes/no
    question, which must give that question's answer: intermediate supervision of
    the binding of question words to the image (the answer position then only has
    to read it from a few tokens back).
    """
    width = model.model.multi_modal_projector.linear_2.out_features
    heads = patch_heads(width)
    question_head = torch.nn.Linear(width, QUESTION_PROBE_CLASSES)
    params = [*model.parameters(), *heads.parameters(), *question_head.parameters()]
    probe_on = cfg.question_probe_weight > 0
    optimizer, scheduler = _optimizer(params, lr, steps, cfg)
    losses: list[float] = []
    accuracy: list[float] = []
    probe_accuracy: list[float] = []
    projected: list[torch.Tensor] = []  # the projector's output [B, P, hidden] of the current step
    hook = model.model.multi_modal_projector.register_forward_hook(lambda _m, _i, out: projected.append(out))
    bar = tqdm(range(steps), desc=name, unit="step", dynamic_ncols=True)
    for step in bar:
        batch = stream.batch(step)
        labels = batch.pop("patch_labels")
        probe_labels = batch.pop("probe_labels")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            out = model(**batch, output_hidden_states=probe_on)
            features = projected.pop().reshape(labels.shape[0], labels.shape[2], -1)
            aux, shape_accuracy = patch_loss(heads(features), labels)
            loss = out.loss + cfg.patch_loss_weight * aux
            probed = probe_labels != IGNORE_INDEX
            if probe_on and bool(probed.any()):
                layer = min(cfg.question_probe_layer, len(out.hidden_states) - 1)  # small test models
                hidden = out.hidden_states[layer]  # [B, T, width]
                probe_logits = question_head(hidden[probed]).float()
                loss = loss + cfg.question_probe_weight * F.cross_entropy(probe_logits, probe_labels[probed])
                probe_accuracy.append((probe_logits.argmax(-1) == probe_labels[probed]).float().mean().item())
        _step(loss, params, optimizer, scheduler, cfg)
        losses.append(out.loss.item())
        accuracy.append(shape_accuracy)
        if step % 25 == 0 or step == steps - 1:
            recent = sum(losses[-25:]) / len(losses[-25:])
            bar.set_postfix(loss=f"{recent:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            probe = f"  question probe acc {sum(probe_accuracy[-25:]) / len(probe_accuracy[-25:]):.3f}" if probe_accuracy else ""
            tqdm.write(f"step {step:5d}  loss {recent:.4f}  patch shape acc {sum(accuracy[-25:]) / len(accuracy[-25:]):.3f}{probe}")
    hook.remove()
    return sum(losses[-50:]) / len(losses[-50:])


def _conversation_stages(
    model: LlavaForConditionalGeneration,
    tokenizer: PreTrainedTokenizerFast,
    image_processor: CLIPImageProcessorPil,
    cfg: TrainConfig,
    start_stage: int,
) -> float:
    """Stage 2 (all question kinds) then stage 3 (grounded questions); returns the last stage's loss.

    Stage 3 re-seeds torch (``seed + 3``), so resuming at stage 3 from a saved
    stage-2 checkpoint gives the same weights as one uninterrupted run.
    """
    encoder = ConversationEncoder(tokenizer, model.config.image_token_id)
    loss = float("nan")
    if start_stage <= 2:
        stream = TrainingStream(encoder, image_processor, cfg.seed, cfg.batch_size,
                                grounded=cfg.grounded, caption_first=cfg.caption_first)
        loss = train_conversations(model, stream, cfg.steps, cfg.lr, cfg, "stage 2 (llava)")
    if cfg.qa_steps:
        torch.manual_seed(cfg.seed + 3)
        stream = TrainingStream(encoder, image_processor, cfg.seed, cfg.batch_size, QA_NAMESPACE, grounded=True)
        loss = train_conversations(model, stream, cfg.qa_steps, cfg.qa_lr, cfg, "stage 3 (grounded QA)")
    return loss


def train(out_dir: Path, cfg: TrainConfig, size: ModelSize | None = None, start_stage: int = 1) -> TrainResult:
    """Train into ``out_dir`` (created; existing files are overwritten).

    ``start_stage`` 1 trains from scratch; 3 loads the stage-2 checkpoint saved in
    ``out_dir`` (e.g. by a run with ``qa_steps=0``) and runs stage 3 only.

    Raises:
        ValueError: for a ``start_stage`` other than 1 or 3.
    """
    if start_stage not in (1, 3) or (start_stage == 3 and not cfg.qa_steps):
        raise ValueError(f"start_stage must be 1, or 3 with qa_steps > 0; got {start_stage}, qa_steps {cfg.qa_steps}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    vision_accuracy = float("nan")
    if start_stage == 1:
        tokenizer = prepare_checkpoint_files(out_dir)
        torch.manual_seed(cfg.seed)
        model = build_model(tokenizer, size)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
        model = LlavaForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32)
    image_processor = CLIPImageProcessorPil.from_pretrained(out_dir)
    model.train()
    if start_stage == 1 and cfg.vision_steps:
        vision_accuracy = warm_up_vision(model, image_processor, cfg)
    final_loss = _conversation_stages(model, tokenizer, image_processor, cfg, start_stage)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=24,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    result = TrainResult(out_dir, seconds, cpu_seconds, final_loss, vision_accuracy)
    _write_training_md(cfg, result, start_stage)
    return result
