"""Models of the families users bring, built from configs (random weights, no download), and the data each reads:
a diffusion model whose noise schedule is a plain tensor attribute, a vision-language model with a parameter it never
uses, an audio encoder-decoder, and a model with a branch used only on even steps.

`model=custom model._target_=family_models.Denoiser data=custom data._target_=family_models.noisy_images`
(tests/ is on the workers' PYTHONPATH). diffusers and transformers are imported where a model is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SIZE, STEPS = 8, 50


class Denoiser(nn.Module):
    """A diffusers UNet2DModel that predicts the noise a DDPMScheduler added: the scheduler's `alphas_cumprod` is a
    tensor attribute of the scheduler, neither a parameter nor a buffer. The noise and the timestep come with each
    sample."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        from diffusers import DDPMScheduler, UNet2DModel

        self.unet = UNet2DModel(
            sample_size=SIZE,
            in_channels=1,
            out_channels=1,
            layers_per_block=1,
            block_out_channels=(width, 2 * width),
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"),
            norm_num_groups=4,
        )
        self.scheduler = DDPMScheduler(num_train_timesteps=STEPS)

    def forward(self, image: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        noisy = self.scheduler.add_noise(image, noise, timestep)
        return F.mse_loss(self.unet(noisy, timestep).sample, noise)


class NoisyImages(Dataset):
    """Seeded smooth images, each with its own noise and timestep."""

    def __init__(self, split: str, count: int) -> None:
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        grid = torch.linspace(-1, 1, SIZE)
        phase = torch.rand(count, 1, 1, 1, generator=generator) * 6
        self.images = torch.sin(3 * grid[None, None, :, None] + phase) * torch.cos(2 * grid[None, None, None, :])
        self.noise = torch.randn(count, 1, SIZE, SIZE, generator=generator)
        self.timesteps = torch.randint(0, STEPS, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "noise": self.noise[i], "timestep": self.timesteps[i]}


def noisy_images(split: str, count: int = 64) -> NoisyImages:
    return NoisyImages(split, count if split == "train" else count // 4)


VOCAB, IMAGE_TOKEN, IMAGE, PATCH, TEXT = 128, 127, 16, 8, 12
PATCHES = (IMAGE // PATCH) ** 2


def llava() -> nn.Module:
    """A tiny LLaVA (CLIP vision tower, Llama text model): it reads the tower's hidden states, never its pooled output,
    so CLIP's `post_layernorm` gets no gradient."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE,
        patch_size=PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_seq_length=PATCHES
    )
    return LlavaForConditionalGeneration(config)


class ImageText(Dataset):
    """An image and a caption: `input_ids` hold one image token per patch, then the caption; the image tokens are no
    targets (-100)."""

    def __init__(self, split: str, count: int) -> None:
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.pixels = torch.randn(count, 3, IMAGE, IMAGE, generator=generator)
        caption = torch.randint(1, IMAGE_TOKEN, (count, TEXT), generator=generator)
        self.ids = torch.cat([torch.full((count, PATCHES), IMAGE_TOKEN), caption], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.ids[i] == IMAGE_TOKEN, -100)
        return {"input_ids": self.ids[i], "pixel_values": self.pixels[i], "labels": labels}


def image_text(split: str, count: int = 64) -> ImageText:
    return ImageText(split, count if split == "train" else count // 4)


MELS, FRAMES = 8, 32


def whisper() -> nn.Module:
    """A tiny Whisper (an audio encoder-decoder) from a config."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=MELS,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            d_model=16,
            max_source_positions=FRAMES // 2,
            max_target_positions=32,
            decoder_start_token_id=1,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        )
    )


class Speech(Dataset):
    """Log-mel-like features and a transcript of token ids."""

    def __init__(self, split: str, count: int) -> None:
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.features = torch.randn(count, MELS, FRAMES, generator=generator)
        self.labels = torch.randint(3, VOCAB, (count, 8), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_features": self.features[i], "labels": self.labels[i]}


def speech(split: str, count: int = 64) -> Speech:
    return Speech(split, count if split == "train" else count // 4)


class EvenStepBranch(nn.Module):
    """Points in, a class out; `branch` runs only in its even training forwards (at accumulation 1: even steps), so
    its parameters get no gradient in odd steps, the first one included."""

    def __init__(self, dim: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.branch = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.calls = 0

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.training:
            self.calls += 1
        h = torch.relu(self.body(x))
        if self.calls % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        return F.cross_entropy(self.head(h), label)
