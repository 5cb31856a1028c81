"""The whole served model: optional vision tower + projector, and our Llama decoder.

Image features replace the embeddings of image-token positions, in order
(each ``<image>`` placeholder was expanded to ``num_image_tokens`` ids before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mm_serve.kernels.attention_backend import AttentionBackend
from mm_serve.models.llama import LlamaForCausalLM
from mm_serve.models.model_config import ModelConfig
from mm_serve.models.projector import MultiModalProjector

if TYPE_CHECKING:  # imported where a tower is built: transformers' modeling stack takes ~3 s to import,
    from mm_serve.models.qwen2_vl.tower import MergedPatchTower  # which the API process never needs
    from mm_serve.models.vision_encoder import VisionEncoder


class MultimodalLM(nn.Module):
    """A llava-hf checkpoint (or a text-only Llama one) ready to run.

    With ``vision`` False no tower or projector is built, even for a llava checkpoint: a decode
    worker receives each image's embeddings through the hand-off and never sees pixels (the
    CLIP ViT-L/14-336 tower of llava-1.5 is ~300 M parameters, 1.2 GB in float32, per worker).

    Attributes:
        language_model: our :class:`LlamaForCausalLM`.
        vision: the CLIP tower (None for text-only checkpoints, or built without it).
        projector: the LLaVA projector (None for text-only checkpoints, or built without it).
    """

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, language_model: LlamaForCausalLM | None = None,
        vision: bool = True,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.language_model = language_model or LlamaForCausalLM(cfg.text, backend)
        self.vision: VisionEncoder | MergedPatchTower | None = None
        self.projector: MultiModalProjector | None = None
        if cfg.vision is not None and cfg.vision.dynamic_resolution and vision:  # Qwen2-VL: the merger projects
            from mm_serve.models.qwen2_vl.tower import MergedPatchTower

            self.vision = MergedPatchTower(cfg.vision)
        elif cfg.vision is not None and vision:
            from mm_serve.models.vision_encoder import VisionEncoder

            self.vision = VisionEncoder(cfg.vision)
            self.projector = MultiModalProjector(
                self.vision.out_features, cfg.text.hidden_size, cfg.vision.projector_hidden_act,
                cfg.vision.projector_bias,
            )
        self.num_encoded_images = 0  # images through encode_image_list (a tiled image counts once)
        # LLaVA-NeXT: the embedding after every row of an image's tile features
        self.image_newline: nn.Parameter | None = None
        if cfg.vision is not None and cfg.vision.any_resolution and vision:
            self.image_newline = nn.Parameter(torch.zeros(cfg.text.hidden_size))

    @property
    def image_token_index(self) -> int | None:
        return None if self.config.vision is None else self.config.vision.image_token_index

    @property
    def num_image_tokens(self) -> int:
        return 0 if self.config.vision is None else self.config.vision.num_image_tokens

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected patch embeddings ``[N, num_image_tokens, text_hidden]`` for ``[N, 3, H, W]``.

        Raises:
            ValueError: no vision tower (a text-only checkpoint, or built with ``vision`` False).
        """
        if self.vision is None or self.projector is None:
            if self.config.vision is not None and self.config.vision.dynamic_resolution:
                raise ValueError("this model is of a dynamic-resolution family: its tower takes patches and grids "
                                 "(encode_image_list), not a batch of square images")
            what = "text-only" if self.config.vision is None else "built without its vision tower"
            raise ValueError(f"this model is {what}; it cannot take images")
        from mm_serve.models.vision_encoder import VisionEncoder

        assert isinstance(self.vision, VisionEncoder)
        return self.projector(self.vision(pixel_values))

    def encode_image_list(self, images: Sequence[torch.Tensor],
                          sizes: Sequence[tuple[int, ...] | None]) -> list[torch.Tensor]:
        """Projected embeddings ``[tokens_i, text_hidden]`` of each image, its pixels ``[3, H, W]``
        (LLaVA-1.5: one tile, its original ``sizes[i]`` unused) or its tiles ``[T, 3, H, W]`` (LLaVA-NeXT:
        the whole image, then its grid, packed with its original ``sizes[i]``) or its patches
        ``[t*h*w, C*T*P*P]`` (Qwen2-VL, ``sizes[i]`` its patch grid ``(h, w)``, a video's ``(t, h, w)``), in one
        pass of the tower.

        ``num_encoded_images`` counts the images, so tests and metrics can prove an image was encoded once.

        Raises:
            ValueError: no vision tower.
        """
        self.num_encoded_images += len(images)
        vcfg = self.config.vision
        if vcfg is not None and vcfg.dynamic_resolution:  # Qwen2-VL: patches [t*h*w, C*T*P*P], sizes = patch grids
            from mm_serve.models.qwen2_vl.tower import MergedPatchTower

            if self.vision is None or any(size is None for size in sizes):
                raise ValueError("a dynamic-resolution image needs the tower and its patch grid")
            assert isinstance(self.vision, MergedPatchTower)
            return self.vision.encode(images, [s for s in sizes if s is not None])
        if vcfg is not None and vcfg.any_resolution:
            return self._encode_tiled(images, sizes)
        batch = self.encode_images(torch.stack([p if p.dim() == 3 else p[0] for p in images]))
        return list(batch)

    def _encode_tiled(self, images: Sequence[torch.Tensor], sizes: Sequence[tuple[int, ...] | None]) -> list[torch.Tensor]:
        """LLaVA-NeXT: every tile of every image through the tower in one pass, then each image's
        tiles packed (:func:`~mm_serve.models.llava_next.packing.pack_image`)."""
        from mm_serve.models.llava_next.packing import pack_image

        vcfg = self.config.vision
        assert vcfg is not None and self.image_newline is not None
        tiles = [p if p.dim() == 4 else p[None] for p in images]
        features = torch.split(self.encode_images(torch.cat(tiles, dim=0)), [t.shape[0] for t in tiles], dim=0)
        out = []
        for feats, size in zip(features, sizes, strict=True):
            if size is None:
                raise ValueError("an any-resolution image needs its original size")
            out.append(pack_image(feats, (size[0], size[1]), vcfg.grid_pinpoints, vcfg.image_size, vcfg.image_size // vcfg.patch_size,
                                  self.image_newline, vcfg.max_num_patches))
        return out

    def embed(
        self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None, image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input embeddings ``[T, hidden]``; image positions take ``image_embeds`` ``[M, hidden]`` in order.

        Image positions are ``image_mask`` (bool ``[T]``) when given, else every position
        holding the image token. The runner passes a mask when a recomputed sequence has
        outputs equal to the image token id: those are text (their table embedding, as in
        transformers' ``generate``, which feeds generated ids through the embedding table).

        Raises:
            ValueError: the number of image positions differs from ``M``.
        """
        embeds = self.language_model.embed(input_ids)
        if self.image_token_index is None:
            return embeds
        placeholders = torch.tensor(self.config.vision.placeholder_ids, device=input_ids.device)  # type: ignore[union-attr]
        mask = image_mask if image_mask is not None else torch.isin(input_ids, placeholders)
        count = int(mask.sum())
        supplied = 0 if image_embeds is None else int(image_embeds.shape[0])
        if count != supplied:
            raise ValueError(f"prompt has {count} image-token positions but {supplied} image embeddings")
        if count:
            assert image_embeds is not None
            embeds = embeds.clone()
            embeds[mask] = image_embeds.to(embeds.dtype)
        return embeds
