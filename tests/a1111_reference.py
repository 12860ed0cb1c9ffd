"""The test oracle: the conditioning AUTOMATIC1111's webui (1.10) computes for a prompt, built on transformers'
torch CLIP encoders.

A transcription in spirit of webui's own steps, written apart from sdxl.prompts.syntax (which it must not
import) so that the two can be held against each other:

- modules/prompt_parser.py `parse_prompt_attention`: the bracket syntax into [text, weight] pairs;
- modules/sd_hijack_clip.py `tokenize_line`: the pairs into chunks of 75 tokens (comma backtrack, BREAK),
  each framed as BOS + 75 + EOS with multiplier 1.0 on the frame and the padding;
- modules/sd_hijack_clip.py `process_tokens`: ids after the first EOS set to the pad id where it differs
  from EOS, the encoder run, then the emphasis mode (modules/sd_emphasis.py) applied to its output;
- `forward`: the chunks' outputs joined along the sequence, the pooled output from the first chunk;
- modules/sd_models_xl.py: SDXL's two encoders (their penultimate layer, no final layer norm) joined along
  the features, the pooled embedding the second's; an empty negative prompt all zeros.

- modules/prompt_parser.py `get_learned_conditioning_prompt_schedules`: prompt editing ([a:b:0.5]) and
  alternation ([a|b]) as a schedule of (last step, text), over webui's own lark grammar;
  `reconstruct_cond_batch`: which entry a denoiser call reads.

Emphasis modes take webui's names: "Original", "No norm", "None", "Ignore". Textual-inversion embeddings
and AND are outside it.
"""

import re

import lark
import torch

COMMA_PADDING_BACKTRACK = 20  # webui's default "Prompt word wrap length limit"
CHUNK_LENGTH = 75

# webui's pattern, element by element: escapes, brackets, a weight closing a round bracket, text.
RE_ATTENTION = re.compile(
    r"\\\(|\\\)|\\\[|\\]|\\\\|\\|\(|\[|:\s*([+-]?[.\d]+)\s*\)|\)|]|[^\\()\[\]:]+|:"
)
RE_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)


def parse_prompt_attention(text):
    """[[text, weight], ...] for a prompt, with ["BREAK", -1] where the word BREAK stood."""
    res = []
    open_round, open_square = [], []

    def multiply_from(position, factor):
        for entry in res[position:]:
            entry[1] *= factor

    for m in RE_ATTENTION.finditer(text):
        element, weight = m.group(0), m.group(1)
        if element[0] == "\\":
            res.append([element[1:], 1.0])
        elif element == "(":
            open_round.append(len(res))
        elif element == "[":
            open_square.append(len(res))
        elif weight is not None and open_round:
            multiply_from(open_round.pop(), float(weight))
        elif element == ")" and open_round:
            multiply_from(open_round.pop(), 1.1)
        elif element == "]" and open_square:
            multiply_from(open_square.pop(), 1 / 1.1)
        else:
            for i, part in enumerate(RE_BREAK.split(element)):
                if i > 0:
                    res.append(["BREAK", -1])
                res.append([part, 1.0])

    for position in open_round:
        multiply_from(position, 1.1)
    for position in open_square:
        multiply_from(position, 1 / 1.1)

    if not res:
        res = [["", 1.0]]

    i = 0
    while i + 1 < len(res):
        if res[i][1] == res[i + 1][1]:
            res[i][0] += res[i + 1][0]
            del res[i + 1]
        else:
            i += 1
    return res


def tokenize_line(line, tokenizer, emphasis="Original", backtrack=COMMA_PADDING_BACKTRACK):
    """The chunks of a prompt, each (77 token ids, 77 multipliers), and webui's token count."""
    parsed = [[line, 1.0]] if emphasis == "None" else parse_prompt_attention(line)
    tokenized = tokenizer([text for text, _ in parsed], truncation=False, add_special_tokens=False)["input_ids"]
    comma = tokenizer.convert_tokens_to_ids(",</w>")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    state = {"tokens": [], "mults": [], "last_comma": -1, "count": 0}
    result = []

    def next_chunk(is_last=False):
        tokens, mults = state["tokens"], state["mults"]
        state["count"] += len(tokens) if is_last else CHUNK_LENGTH
        missing = CHUNK_LENGTH - len(tokens)
        result.append(([bos] + tokens + [eos] * missing + [eos], [1.0] + mults + [1.0] * missing + [1.0]))
        state.update(tokens=[], mults=[], last_comma=-1)

    for tokens, (text, weight) in zip(tokenized, parsed):
        if text == "BREAK" and weight == -1:
            next_chunk()
            continue
        for token in tokens:
            chunk = state["tokens"]
            if token == comma:
                state["last_comma"] = len(chunk)
            elif (backtrack != 0 and len(chunk) == CHUNK_LENGTH and state["last_comma"] != -1
                  and len(chunk) - state["last_comma"] <= backtrack):
                split = state["last_comma"] + 1
                carried_tokens, carried_mults = chunk[split:], state["mults"][split:]
                state["tokens"], state["mults"] = chunk[:split], state["mults"][:split]
                next_chunk()
                state["tokens"], state["mults"] = carried_tokens, carried_mults
            if len(state["tokens"]) == CHUNK_LENGTH:
                next_chunk()
            state["tokens"].append(token)
            state["mults"].append(weight)

    if state["tokens"] or not result:
        next_chunk(is_last=True)
    return result, state["count"]


def process_tokens(tokens, multipliers, tokenizer, model, layer, emphasis="Original"):
    """One chunk through one encoder: ([1, 77, D] after emphasis, pooled [1, P] or None)."""
    ids = torch.tensor([tokens])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos != pad:
        first_end = tokens.index(eos)
        ids[0, first_end + 1:] = pad
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    z = out.hidden_states[-2] if layer == "penultimate" else out.last_hidden_state
    pooled = getattr(out, "text_embeds", None)

    mults = torch.tensor([multipliers])
    if emphasis == "Original":
        before = z.mean()
        z = z * mults.reshape(mults.shape + (1,)).expand(z.shape)
        after = z.mean()
        z = z * (before / after)
    elif emphasis == "No norm":
        z = z * mults.reshape(mults.shape + (1,)).expand(z.shape)
    return z, pooled


def encode(prompt, tokenizer, model, layer, emphasis="Original"):
    """A prompt through one encoder: ([1, 77 * chunks, D], the first chunk's pooled output or None)."""
    chunks, _ = tokenize_line(prompt, tokenizer, emphasis)
    outputs = [process_tokens(tokens, mults, tokenizer, model, layer, emphasis) for tokens, mults in chunks]
    return torch.hstack([z for z, _ in outputs]), outputs[0][1]


def sdxl_conditioning(prompt, tokenizers, models, emphasis="Original", negative=False):
    """SDXL: ([1, 77k, D1 + D2], pooled [1, P]) from CLIP-L (`CLIPTextModel`) and OpenCLIP-G
    (`CLIPTextModelWithProjection`), both at their penultimate layer; an empty negative prompt is zeros."""
    (tokenizer_1, tokenizer_2), (model_1, model_2) = tokenizers, models
    z1, _ = encode(prompt, tokenizer_1, model_1, "penultimate", emphasis)
    z2, pooled = encode(prompt, tokenizer_2, model_2, "penultimate", emphasis)
    z = torch.cat([z1, z2], dim=-1)
    if negative and prompt == "":
        return torch.zeros_like(z), torch.zeros_like(pooled)
    return z, pooled


def sd1_conditioning(prompt, tokenizer, model, emphasis="Original"):
    """SD 1.x (and 2.x with its truncated encoder): [1, 77k, D] from the encoder's last hidden state, which
    transformers gives after the final layer norm (webui's default "Clip skip" 1)."""
    z, _ = encode(prompt, tokenizer, model, "last", emphasis)
    return z


# webui's schedule grammar (1.10), as it is.
SCHEDULE_PARSER = lark.Lark(r"""
!start: (prompt | /[][():]/+)*
prompt: (emphasized | scheduled | alternate | plain | WHITESPACE)*
!emphasized: "(" prompt ")"
        | "(" prompt ":" prompt ")"
        | "[" prompt "]"
scheduled: "[" [prompt ":"] prompt ":" [WHITESPACE] NUMBER [WHITESPACE] "]"
alternate: "[" prompt ("|" [prompt])+ "]"
WHITESPACE: /\s+/
plain: /([^\\\[\]():|]|\\.)+/
%import common.SIGNED_NUMBER -> NUMBER
""")


def prompt_schedule(prompt, base_steps, hires_steps=None):
    """[[last step, text], ...] for a prompt, as webui's `get_learned_conditioning_prompt_schedules` (not its
    "old scheduling" option): a hires pass counts its own steps on from the first pass's."""
    if hires_steps is None:
        int_offset, flt_offset, steps = 0, 0.0, base_steps
    else:
        int_offset, flt_offset, steps = base_steps, 1.0, hires_steps
    try:
        tree = SCHEDULE_PARSER.parse(prompt)
    except lark.exceptions.LarkError:
        return [[steps, prompt]]

    ends = {steps}

    class CollectSteps(lark.Visitor):
        def scheduled(self, node):
            written = node.children[-2]
            value = float(written)
            value = (value - flt_offset) * steps if "." in written else value - int_offset
            node.children[-2] = min(steps, int(value))
            if node.children[-2] >= 1:
                ends.add(node.children[-2])

        def alternate(self, node):
            ends.update(range(1, steps + 1))

    CollectSteps().visit(tree)

    def at_step(step):
        class AtStep(lark.Transformer):
            def scheduled(self, args):
                before, after, _, when, _ = args
                yield before or () if step <= when else after

            def alternate(self, args):
                args = ["" if not arg else arg for arg in args]
                yield args[(step - 1) % len(args)]

            def start(self, args):
                def flatten(x):
                    if isinstance(x, str):
                        yield x
                    else:
                        for part in x:
                            yield from flatten(part)

                return "".join(flatten(args))

            def plain(self, args):
                yield args[0].value

            def __default__(self, data, children, meta):
                yield from children

        return AtStep().transform(tree)

    return [[end, at_step(end)] for end in sorted(ends)]


def scheduled_entry(schedule, current_step):
    """webui's `reconstruct_cond_batch`: the entry a denoiser call reads at its `self.step` (calls counted from 0)."""
    for entry in schedule:
        if current_step <= entry[0]:
            return entry
    return schedule[0]
