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

Textual-inversion embeddings, as webui places them:

- modules/textual_inversion/textual_inversion.py `EmbeddingDatabase`: each name's token ids (by the first
  encoder's tokenizer, SDXL's CLIP-L one for both encoders), looked up by the first id, longest first;
- `tokenize_line`: where a piece's tokens spell a name, its n vectors take n positions (placeholder id 0,
  the piece's multiplier), the chunk closing first when they do not fit; a "fix" records where they go;
- modules/sd_hijack.py `EmbeddingsWithFixes`: the token embeddings at those positions replaced by the vectors
  (for SDXL each encoder's own, `clip_l` or `clip_g`), before the position embeddings are added.

Prompt editing:

- modules/prompt_parser.py `get_learned_conditioning_prompt_schedules`: prompt editing ([a:b:0.5]) and
  alternation ([a|b]) as a schedule of (last step, text), over webui's own lark grammar;
  `reconstruct_cond_batch`: which entry a denoiser call reads.

Emphasis modes take webui's names: "Original", "No norm", "None", "Ignore". AND is outside it.
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


class EmbeddingDatabase:
    """webui's lookup of embedding names: {name: vectors}, vectors a [n, C] tensor or SDXL's {"clip_l": ...,
    "clip_g": ...}, the names read by `tokenizer`."""

    def __init__(self, embeddings, tokenizer):
        self.vectors = dict(embeddings)
        self.ids_lookup = {}
        for name in self.vectors:
            ids = tokenizer([name], truncation=False, add_special_tokens=False)["input_ids"][0]
            entries = self.ids_lookup.setdefault(ids[0], [])
            self.ids_lookup[ids[0]] = sorted([*entries, (ids, name)], key=lambda entry: len(entry[0]), reverse=True)

    def count(self, name):
        vectors = self.vectors[name]
        return (vectors["clip_g"] if isinstance(vectors, dict) else vectors).shape[0]

    def find_embedding_at_position(self, tokens, offset):
        """(name, how many tokens it spells) or (None, None)."""
        for ids, name in self.ids_lookup.get(tokens[offset], []):
            if tokens[offset:offset + len(ids)] == ids:
                return name, len(ids)
        return None, None


def tokenize_line(line, tokenizer, emphasis="Original", backtrack=COMMA_PADDING_BACKTRACK, database=None):
    """The chunks of a prompt, each (77 token ids, 77 multipliers, fixes), and webui's token count. The fixes
    are (offset, embedding name) pairs: its vectors go at positions offset + 1 on (after BOS)."""
    parsed = [[line, 1.0]] if emphasis == "None" else parse_prompt_attention(line)
    tokenized = tokenizer([text for text, _ in parsed], truncation=False, add_special_tokens=False)["input_ids"]
    comma = tokenizer.convert_tokens_to_ids(",</w>")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    state = {"tokens": [], "mults": [], "fixes": [], "last_comma": -1, "count": 0}
    result = []

    def next_chunk(is_last=False):
        tokens, mults = state["tokens"], state["mults"]
        state["count"] += len(tokens) if is_last else CHUNK_LENGTH
        missing = CHUNK_LENGTH - len(tokens)
        result.append(([bos] + tokens + [eos] * missing + [eos], [1.0] + mults + [1.0] * missing + [1.0],
                       state["fixes"]))
        state.update(tokens=[], mults=[], fixes=[], last_comma=-1)

    for tokens, (text, weight) in zip(tokenized, parsed):
        if text == "BREAK" and weight == -1:
            next_chunk()
            continue
        position = 0
        while position < len(tokens):
            token = tokens[position]
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
            name, spelled = (None, None) if database is None else database.find_embedding_at_position(tokens, position)
            if name is None:
                state["tokens"].append(token)
                state["mults"].append(weight)
                position += 1
                continue
            count = database.count(name)
            if len(state["tokens"]) + count > CHUNK_LENGTH:
                next_chunk()
            state["fixes"].append((len(state["tokens"]), name))
            state["tokens"] += [0] * count
            state["mults"] += [weight] * count
            position += spelled

    if state["tokens"] or not result:
        next_chunk(is_last=True)
    return result, state["count"]


def encode_with_transformers(model, ids, layer, clip_skip=None):
    """webui's `encode_with_transformers`: ([1, 77, D], the transformers output). "last": SD 1.x's
    encoder, whose "Clip skip" N > 1 reads `hidden_states[-N]` through the final layer norm;
    "penultimate": SDXL's, unnormed, CLIP-L's at `hidden_states[-N]` instead where its setting
    `sdxl_clip_l_skip` is on. `clip_skip` None: an encoder webui never skips in (OpenCLIP's)."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        if layer == "penultimate":
            return out.hidden_states[-2 if clip_skip is None else -clip_skip], out
        if clip_skip is not None and clip_skip > 1:
            text_model = getattr(model, "text_model", model)  # transformers 5's CLIPTextModel is its text model
            return text_model.final_layer_norm(out.hidden_states[-clip_skip]), out
        return out.last_hidden_state, out


class EmbeddingsWithFixes(torch.nn.Module):
    """webui's wrapper of an encoder's token embedding: the vectors of a chunk's fixes in place of the tokens'."""

    def __init__(self, wrapped, vectors):
        super().__init__()
        self.wrapped, self.vectors = wrapped, vectors  # vectors: [(offset, [n, C] tensor)]

    def forward(self, input_ids):
        inputs_embeds = self.wrapped(input_ids)
        for offset, vec in self.vectors:
            emb_len = min(inputs_embeds.shape[1] - offset - 1, vec.shape[0])
            vectors = vec[None, :emb_len].to(inputs_embeds.dtype).expand(inputs_embeds.shape[0], -1, -1)
            inputs_embeds = torch.cat([inputs_embeds[:, :offset + 1], vectors, inputs_embeds[:, offset + 1 + emb_len:]],
                                      dim=1)
        return inputs_embeds


def process_tokens(tokens, multipliers, tokenizer, model, layer, emphasis="Original", clip_skip=None, fixes=(),
                   database=None, key=None):
    """One chunk through one encoder: ([1, 77, D] after emphasis, pooled [1, P] or None). `fixes` (offset,
    name) place `database`'s vectors (SDXL's: those under `key`)."""
    ids = torch.tensor([tokens])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos != pad:
        first_end = tokens.index(eos)
        ids[0, first_end + 1:] = pad
    token_embedding = model.get_input_embeddings()
    vectors = [(offset, database.vectors[name][key] if key else database.vectors[name]) for offset, name in fixes]
    model.set_input_embeddings(EmbeddingsWithFixes(token_embedding, vectors))
    try:
        z, out = encode_with_transformers(model, ids, layer, clip_skip)
    finally:
        model.set_input_embeddings(token_embedding)
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


def encode(prompt, tokenizer, model, layer, emphasis="Original", clip_skip=None, database=None, key=None):
    """A prompt through one encoder: ([1, 77 * chunks, D], the first chunk's pooled output or None)."""
    chunks, _ = tokenize_line(prompt, tokenizer, emphasis, database=database)
    outputs = [process_tokens(tokens, mults, tokenizer, model, layer, emphasis, clip_skip, fixes, database, key)
               for tokens, mults, fixes in chunks]
    return torch.hstack([z for z, _ in outputs]), outputs[0][1]


def sdxl_conditioning(prompt, tokenizers, models, emphasis="Original", negative=False, clip_skip=1,
                      sdxl_clip_l_skip=False, embeddings=None):
    """SDXL: ([1, 77k, D1 + D2], pooled [1, P]) from CLIP-L (`CLIPTextModel`) and OpenCLIP-G
    (`CLIPTextModelWithProjection`), both at their penultimate layer (CLIP-L's `clip_skip` back where
    `sdxl_clip_l_skip`); an empty negative prompt is zeros. `embeddings`: {name: {"clip_l": [n, D1],
    "clip_g": [n, D2]}}, the names read by CLIP-L's tokenizer."""
    (tokenizer_1, tokenizer_2), (model_1, model_2) = tokenizers, models
    database = EmbeddingDatabase(embeddings, tokenizer_1) if embeddings else None
    z1, _ = encode(prompt, tokenizer_1, model_1, "penultimate", emphasis, clip_skip if sdxl_clip_l_skip else None,
                   database, "clip_l")
    z2, pooled = encode(prompt, tokenizer_2, model_2, "penultimate", emphasis, None, database, "clip_g")
    z = torch.cat([z1, z2], dim=-1)
    if negative and prompt == "":
        return torch.zeros_like(z), torch.zeros_like(pooled)
    return z, pooled


def sd1_conditioning(prompt, tokenizer, model, emphasis="Original", clip_skip=1, embeddings=None):
    """SD 1.x (and 2.x with its truncated encoder, where webui's clip skip is always 1): [1, 77k, D] from
    the encoder's last hidden state, which transformers gives after the final layer norm (webui's default
    "Clip skip" 1), or with `clip_skip` N the state N back, normed the same way. `embeddings`: {name: [n, D]}."""
    database = EmbeddingDatabase(embeddings, tokenizer) if embeddings else None
    z, _ = encode(prompt, tokenizer, model, "last", emphasis, clip_skip, database)
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
