"""Tiny random CLIP / ImageReward / HPSv2.1 models for the metric tests, saved in the official file layouts.

Each builder makes a seeded random model with the architecture of `transformers` (an implementation independent
of the project's: ``CLIPModel``, ``BlipVisionModel`` + ``BlipTextModel``), maps its weights to the released key
layout by hand (the mapping below is the test's own statement of that layout) and writes the files a user would
have: a Hugging Face CLIP folder; ``ImageReward.pt`` + ``bert-base-uncased/vocab.txt``;
``HPS_v2.1_compressed.pt`` + ``model_config.json`` + ``tokenizer/``. The returned reference models compute the
expected scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
BERT_WORDS = ["a", "photo", "of", "object", "class", "red", "cat", "blue", "dog", "an", "image", "green", "car",
              "two", "three", "on", "the", "left", "right"] + [str(i) for i in range(10)]


def clip_vocab(specials_last: bool = False) -> dict[str, int]:
    """Byte-level BPE vocabulary of single characters (no merges): ``c`` and ``c</w>`` for letters and digits;
    the two special tokens first, or last (OpenCLIP: end-of-text has the largest id)."""
    body = [t for c in CHARS for t in (c, c + "</w>")]
    specials = ["<|startoftext|>", "<|endoftext|>"]
    tokens = body + specials if specials_last else specials + body
    return {t: i for i, t in enumerate(tokens)}


def clip_tokenizer(specials_last: bool = False):
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab=clip_vocab(specials_last), merges=[])


def _quiet():
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(logging.ERROR)


def make_clip_folder(folder: Path, seed: int = 0, image_size: int = 32, aligned: bool = False):
    """A Hugging Face CLIP folder (model, tokenizer, image processor); returns the model. ``aligned``: image and
    text embeddings share a positive first component (final LayerNorm biases 1, first projection rows 1), so the
    cosines are positive and CLIP scores non-zero, as for a trained CLIP."""
    _quiet()
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = clip_vocab()
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=48, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        projection_dim=16)
    torch.manual_seed(seed)
    model = CLIPModel(cfg).eval()
    if aligned:
        with torch.no_grad():
            model.vision_model.post_layernorm.bias.fill_(1.0)
            model.text_model.final_layer_norm.bias.fill_(1.0)
            model.visual_projection.weight[0].fill_(1.0)
            model.text_projection.weight[0].fill_(1.0)
    processor = CLIPProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                                                    crop_size={"height": image_size,
                                                                               "width": image_size}),
                              tokenizer=clip_tokenizer())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def pil_processor(size: int):
    """transformers' CLIP image processor (PIL backend): the reference preprocessing."""
    _quiet()
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


# ----- ImageReward -----------------------------------------------------------------------------------------
def bert_vocab() -> list[str]:
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + BERT_WORDS


def make_image_reward(folder: Path, seed: int = 0, image_size: int = 32):
    """``folder/ImageReward.pt`` (released key layout) and ``folder/bert-base-uncased/vocab.txt``; returns
    ``(vision, text, mlp_layers)``: the transformers BLIP towers and the head's Linear layers."""
    _quiet()
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    torch.manual_seed(seed)
    vcfg = BlipVisionConfig(hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                            image_size=image_size, patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu")
    vision = BlipVisionModel(vcfg).eval()
    vocab = bert_vocab()
    tcfg = BlipTextConfig(vocab_size=len(vocab) + 2, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=40, encoder_hidden_size=192,
                          is_decoder=True, layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0)
    text = BlipTextModel(tcfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # the random init leaves LayerNorms at identity: perturb them so they are tested too
        for module in list(vision.modules()) + list(text.modules()):
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
        vision.embeddings.class_embedding.normal_()
        vision.embeddings.position_embedding.normal_(0, 0.5)
    widths = [128, 96, 32, 16, 8, 1]
    mlp = [torch.nn.Linear(widths[i], widths[i + 1]) for i in range(len(widths) - 1)]
    sd: dict[str, torch.Tensor] = {}
    v = "blip.visual_encoder."
    for k, t in vision.state_dict().items():
        k2 = (k.replace("embeddings.class_embedding", "cls_token")
               .replace("embeddings.position_embedding", "pos_embed")
               .replace("embeddings.patch_embedding", "patch_embed.proj")
               .replace("encoder.layers.", "blocks.").replace("layer_norm1", "norm1").replace("layer_norm2", "norm2")
               .replace("self_attn.qkv", "attn.qkv").replace("self_attn.projection", "attn.proj")
               .replace("post_layernorm", "norm"))
        sd[v + k2] = t.clone()
    for k, t in text.state_dict().items():
        sd["blip.text_encoder." + k] = t.clone()
    sd["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]  # in the release, unused
    sd["blip.vision_proj.weight"] = torch.randn(8, 192)  # BLIP heads the release also holds (unused)
    for layer, idx in zip(mlp, (0, 2, 4, 6, 7)):
        sd[f"mlp.layers.{idx}.weight"] = layer.weight.detach().clone()
        sd[f"mlp.layers.{idx}.bias"] = layer.bias.detach().clone()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(sd, folder / "ImageReward.pt")
    tok = folder / "bert-base-uncased"
    tok.mkdir(exist_ok=True)
    (tok / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return vision, text, mlp


# ----- HPSv2.1 ---------------------------------------------------------------------------------------------
def make_hps(folder: Path, seed: int = 0, image_size: int = 32, wrap: bool = True):
    """``folder/HPS_v2.1_compressed.pt`` (open_clip layout, under ``state_dict`` when ``wrap``),
    ``folder/model_config.json`` (open_clip format) and ``folder/tokenizer/``; returns the transformers
    ``CLIPModel`` it was mapped from (GELU, as ViT-H-14)."""
    _quiet()
    from transformers import CLIPConfig, CLIPModel

    vocab = clip_vocab(specials_last=True)
    eot = vocab["<|endoftext|>"]
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=eot - 1, eos_token_id=eot,
                         pad_token_id=eot, hidden_act="gelu"),
        vision_config=dict(hidden_size=160, intermediate_size=320, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8, hidden_act="gelu"),
        projection_dim=24)
    torch.manual_seed(seed)
    model = CLIPModel(cfg).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    hf = model.state_dict()
    sd: dict[str, torch.Tensor] = {}

    def blocks(src: str, dst: str, layers: int):
        for i in range(layers):
            a, b = f"{src}.encoder.layers.{i}.", f"{dst}.resblocks.{i}."
            sd[b + "ln_1.weight"], sd[b + "ln_1.bias"] = hf[a + "layer_norm1.weight"], hf[a + "layer_norm1.bias"]
            sd[b + "ln_2.weight"], sd[b + "ln_2.bias"] = hf[a + "layer_norm2.weight"], hf[a + "layer_norm2.bias"]
            sd[b + "attn.in_proj_weight"] = torch.cat([hf[a + f"self_attn.{p}_proj.weight"] for p in "qkv"])
            sd[b + "attn.in_proj_bias"] = torch.cat([hf[a + f"self_attn.{p}_proj.bias"] for p in "qkv"])
            sd[b + "attn.out_proj.weight"] = hf[a + "self_attn.out_proj.weight"]
            sd[b + "attn.out_proj.bias"] = hf[a + "self_attn.out_proj.bias"]
            for x, y in (("fc1", "c_fc"), ("fc2", "c_proj")):
                sd[b + f"mlp.{y}.weight"], sd[b + f"mlp.{y}.bias"] = hf[a + f"mlp.{x}.weight"], hf[a + f"mlp.{x}.bias"]

    sd["visual.conv1.weight"] = hf["vision_model.embeddings.patch_embedding.weight"]
    sd["visual.class_embedding"] = hf["vision_model.embeddings.class_embedding"]
    sd["visual.positional_embedding"] = hf["vision_model.embeddings.position_embedding.weight"]
    for x, y in (("pre_layrnorm", "ln_pre"), ("post_layernorm", "ln_post")):
        sd[f"visual.{y}.weight"], sd[f"visual.{y}.bias"] = hf[f"vision_model.{x}.weight"], hf[f"vision_model.{x}.bias"]
    blocks("vision_model", "visual.transformer", 2)
    sd["visual.proj"] = hf["visual_projection.weight"].T
    sd["token_embedding.weight"] = hf["text_model.embeddings.token_embedding.weight"]
    sd["positional_embedding"] = hf["text_model.embeddings.position_embedding.weight"]
    blocks("text_model", "transformer", 2)
    sd["ln_final.weight"], sd["ln_final.bias"] = (hf["text_model.final_layer_norm.weight"],
                                                  hf["text_model.final_layer_norm.bias"])
    sd["text_projection"] = hf["text_projection.weight"].T
    sd["logit_scale"] = hf["logit_scale"]
    sd = {("module." + k if wrap else k): v.clone().contiguous() for k, v in sd.items()}  # DDP-trained names
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": sd, "epoch": 1} if wrap else sd, folder / "HPS_v2.1_compressed.pt")
    (folder / "model_config.json").write_text(json.dumps({
        "embed_dim": 24, "vision_cfg": {"image_size": image_size, "layers": 2, "width": 160, "head_width": 80,
                                        "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": len(vocab), "width": 128, "heads": 2, "layers": 2}}))
    clip_tokenizer(specials_last=True).save_pretrained(folder / "tokenizer")
    return model
