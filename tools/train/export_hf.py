"""Export a hybrid.HybridLM to a transformers model folder (device machine: transformers 5.17).

The weights go into transformers' own Qwen3_5ForCausalLM (strict load: every key but the tied lm_head),
its logits are compared with HybridLM's on a random prompt longer than two delta-rule chunks, and the
folder is written by save_pretrained in bf16 with the tokenizer files and a generation config. A
mismatch raises: a model hypic and transformers would read differently is never exported.
"""

import json
import os
import shutil


def export(model, kw, folder, tok_dir, eos, pad, log=print, tol=2e-3):
    import torch
    import transformers
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg_kw = {k: v for k, v in kw.items() if k != "num_hidden_layers"}
    cfg = transformers.Qwen3_5TextConfig(num_hidden_layers=kw["num_hidden_layers"], eos_token_id=eos,
                                         pad_token_id=pad, bos_token_id=None, **cfg_kw)
    hf = transformers.Qwen3_5ForCausalLM(cfg)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing} unexpected {unexpected}")
    hf.tie_weights()
    hf = hf.to(dev).float().eval()
    model_was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, kw["vocab_size"] - 3, (2, 300), generator=g).to(dev)
    with torch.no_grad():
        a = hf(input_ids=ids, use_cache=False).logits.float()
        m32 = model.float()
        b = m32(ids).float()
    err = ((a - b).norm() / a.norm()).item()
    maxerr = (a - b).abs().max().item()
    log(f"export check: HybridLM vs transformers logits rel err {err:.2e}, max abs {maxerr:.2e}")
    if model_was_training:
        model.train()
    if not err < tol:
        raise RuntimeError(f"HybridLM and transformers disagree (rel err {err:.3e} >= {tol})")
    os.makedirs(folder, exist_ok=True)
    hf = hf.to(torch.bfloat16).cpu()
    hf.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None, do_sample=False)
    hf.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(folder, f))
    with open(os.path.join(folder, "export_check.json"), "w") as f:
        json.dump({"logits_rel_err": err, "logits_max_abs_err": maxerr, "transformers": transformers.__version__,
                   "torch": torch.__version__}, f, indent=1)
    log(f"exported to {folder}: {sorted(os.listdir(folder))}")
    return err
