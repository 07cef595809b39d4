"""Chats as token ids: every assistant turn learned, every other turn context, as TRL's SFTTrainer
(`assistant_only_loss`) and the Trainer's chat fine-tunes learn them.

A conversation is rendered with the tokenizer's chat template and cut into segments at the turn boundaries the
template itself draws: for the assistant message i, the rendering of messages[:i] with the generation prompt ends
where its reply starts, and the rendering of messages[:i + 1] ends where it stops. Between those two points lie
the reply's content and the template's end-of-turn text ("<|im_end|>\\n", "<end_of_turn>\\n", eos ...), which the
model must learn to write, or it never stops. Each segment is tokenized on its own, as a prompt is at inference.

    segments -> [context][reply 1][end 1][context][reply 2][end 2] ... [reply N][end N]
    labels   ->  -100     reply 1  end 1   -100    reply 2  end 2  ...  reply N  end N   (all of it: train_on_prompt)

Lengths: each reply is cut to --max_target_length tokens *with* its end-of-turn tokens kept (so a cut reply still
ends the turn), and what comes before the last reply (the prompt generation starts from) keeps its last
--max_source_length tokens. How many replies were cut is counted (`ChatExample.cut`) and reported.

Without a chat template a conversation is written as "role: content" lines, each reply closed by eos.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....core.loss import IGNORE_INDEX
from ....errors import DataError


@dataclass
class ChatExample:
    input_ids: list[int]
    labels: list[int]
    prompt_ids: list[int]  # everything before the last reply: what generation starts from
    replies: int
    cut: int  # replies cut to --max_target_length

    def row(self) -> dict:
        return {"input_ids": self.input_ids, "labels": self.labels, "prompt_ids": self.prompt_ids}


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The chat template's text; a template that refuses the conversation is a DataError with its reason."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja2's TemplateError (raise_exception in the template), or a ValueError
        raise DataError(f"the tokenizer's chat template refused the conversation: {err}. Change the data to what the "
                        "template accepts (Gemma's, for one, has no 'system' role: put the system text at the start "
                        "of the first user message), or give --tokenizer_name with another template.") from None


def template_segments(tokenizer, messages: list[dict]) -> list[tuple[str, str]]:
    """(kind, text) pieces of the rendered conversation, kind "context", "reply" or "end", in order."""
    full = render(tokenizer, messages)
    segments, position = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:i], generation_prompt=True)) if i else 0
        stop = len(render(tokenizer, messages[:i + 1]))
        if start < position or stop < start or not full.startswith(render(tokenizer, messages[:i + 1])):
            raise DataError("the tokenizer's chat template renders a conversation differently from its beginnings "
                            f"(at message {i}), so the replies cannot be told from the rest; use --prompt_column / "
                            "--completion_column instead.")
        span = full[start:stop]
        content = message["content"].strip()
        found = span.find(content) if content else -1
        end = found + len(content) if found >= 0 else len(span)  # not found: the whole span is the reply
        segments += [("context", full[position:start]), ("reply", span[:end]), ("end", span[end:])]
        position = stop
    return [(kind, text) for kind, text in segments if text]


def plain_segments(tokenizer, messages: list[dict]) -> list[tuple[str, str]]:
    """Without a template: 'role: content' lines, 'assistant:' before each reply, eos after it."""
    segments = []
    for message in messages:
        if message["role"] == "assistant":
            segments += [("context", "assistant:"), ("reply", " " + message["content"]),
                         ("end", tokenizer.eos_token)]
        else:
            segments.append(("context", f"{message['role']}: {message['content']}\n"))
    return segments


def chat_example(messages: list[dict], tokenizer, max_source_length: int, max_target_length: int,
                 train_on_prompt: bool = False) -> ChatExample:
    """Token ids, labels and the generation prompt of one conversation (module docstring)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    segments = template_segments(tokenizer, messages) if templated else plain_segments(tokenizer, messages)
    pieces: list[tuple[str, list[int]]] = []
    for i, (kind, text) in enumerate(segments):
        special = not templated and i == 0  # a template writes its own bos; plain lines get the tokenizer's
        pieces.append((kind, tokenizer(text, add_special_tokens=special)["input_ids"]))
    replies = cut = 0
    ids: list[int] = []
    labels: list[int] = []
    last_reply = 0
    for i, (kind, tokens) in enumerate(pieces):
        if kind == "reply":
            end = pieces[i + 1][1] if i + 1 < len(pieces) and pieces[i + 1][0] == "end" else []
            room = max(max_target_length - len(end), 1)
            replies += 1
            if len(tokens) > room:
                tokens, cut = tokens[:room], cut + 1
            last_reply = len(ids)
        learned = kind in ("reply", "end") or train_on_prompt
        ids += tokens
        labels += tokens if learned else [IGNORE_INDEX] * len(tokens)
    # the prompt of the last reply keeps its end (the latest turns and the generation prompt)
    drop = max(last_reply - max_source_length, 0)
    return ChatExample(ids[drop:], labels[drop:], ids[drop:last_reply], replies, cut)
