#!/usr/bin/env python3
"""Turns a chat LM's Hugging Face folder into a zero-shot outcome reward model: a
LlamaForSequenceClassification folder the `outcome-rm` family serves like any trained one.

No trained outcome reward model can be fetched here (no model hub), so this builds the principled
small one that can: the chat model asked, once, whether a whole solution is correct, as `chat-lm`
asks it of each step. Its chat template renders the question and the solution (the outcome-rm
family's user and assistant turns) into one user turn under an instruction, and ends with the
assistant's generation prompt; the score head is the LM head's row of '+' minus its row of '-'. So at
the last token the score is logit('+') - logit('-'), the log-odds of the model's verdict, and
sigmoid(score) is chat-lm's softmax over ('+', '-') for the whole solution as one step.

The decoder's weights are not copied: model.safetensors.index.json names the source file (linked in as
lm.safetensors) and a small score.safetensors with `score.weight` [1, hidden].

Usage: .venv/bin/python scripts/fetch/lm_outcome_rm.py SRC_FOLDER OUT_FOLDER
       (e.g. SmolLM2-135M-Instruct as scripts/fetch-smollm2.sh --f32 converts it)
"""
import json
import os
import shutil
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

INSTRUCTION = ("You check a solution to a problem. Reply with a single character: + if the solution "
               "and its final answer are correct, - if it contains an error.")
TEMPLATE = (
    "{{ '<|im_start|>system\\n" + INSTRUCTION + "<|im_end|>\\n' }}"
    "{{ '<|im_start|>user\\nQuestion: ' + messages[0]['content'] + '\\n\\nSolution: ' "
    "+ messages[1]['content'] + '<|im_end|>\\n' }}"
    "{{ '<|im_start|>assistant\\n' }}"
)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    if cfg.get("model_type") != "llama":
        sys.exit(f"{src}: model_type {cfg.get('model_type')!r}; this script writes a Llama classifier")
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    plus, minus = (tok.encode(t, add_special_tokens=False).ids[-1] for t in ("+", "-"))
    weights = os.path.join(src, "model.safetensors")
    with safe_open(weights, "np") as f:
        names = list(f.keys())
        head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
        table = f.get_tensor(head)
    row = (table[plus].astype(np.float64) - table[minus].astype(np.float64)).astype(np.float32)
    save_file({"score.weight": row[None, :]}, os.path.join(out, "score.safetensors"))
    link = os.path.join(out, "lm.safetensors")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.abspath(weights), link)
    weight_map = {n: "lm.safetensors" for n in names}
    weight_map["score.weight"] = "score.safetensors"
    json.dump({"metadata": {}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=1)
    cfg.update({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"},
                "label2id": {"LABEL_0": 0}})
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    shutil.copyfile(os.path.join(src, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
    tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
    tc["chat_template"] = TEMPLATE
    json.dump(tc, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2, ensure_ascii=False)
    print(json.dumps({"out": out, "plus": plus, "minus": minus, "tensors": len(weight_map),
                      "pad_token_id": cfg.get("pad_token_id")}))


if __name__ == "__main__":
    main()
