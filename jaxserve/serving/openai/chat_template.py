"""A conversation through the model's chat template (chat, Responses, Messages, /tokenize),
and the grammars that force tool calls or follow a reasoning model's thinking."""

from __future__ import annotations

import inspect
import json

import jinja2

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.serving import reasoning, tools
from jaxserve.serving.openai.errors import ApiError, field_error
from jaxserve.serving.openai.front import Front


def template_options(front: Front, body: dict, messages: list[dict]) -> dict:
    """vLLM's add_generation_prompt (default true), continue_final_message (the reply
    goes on from the last, assistant, message instead of starting a new one) and
    chat_template_kwargs (more variables for the template, as enable_thinking)."""
    extra = body.get("chat_template_kwargs")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ApiError(400, "chat_template_kwargs must be an object",
                       param="chat_template_kwargs")
    # apply_chat_template's own arguments are the server's to set
    taken = sorted(set(extra) & (set(inspect.signature(
        front.server.engine.tokenizer.apply_chat_template).parameters) | {"messages"}))
    if taken:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)}",
                       param="chat_template_kwargs")
    opts = dict(extra)
    for name, default in (("add_generation_prompt", True),
                          ("continue_final_message", False)):
        value = body.get(name, default)
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be a boolean", param=name)
        opts[name] = value
    if opts["continue_final_message"]:
        if opts["add_generation_prompt"] and "add_generation_prompt" in body:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot "
                                "both be true", param="continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise ApiError(400, "continue_final_message needs an assistant message last",
                           param="continue_final_message")
        opts["add_generation_prompt"] = False
    return opts


async def chat_prompt(front: Front, body: dict, messages: list[dict],
                      choice: tools.ToolChoice | None, field: str) -> str:
    """The conversation (and tools) through the model's chat template, off the loop;
    `field`: the body's field the messages came from."""
    tok = front.server.engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model has no chat template", param=field)
    chars = sum(len(m["content"]) + len(m.get("reasoning_content", ""))
                + sum(len(c["arguments"]) for c in m.get("tool_calls", ())) for m in messages)
    chars += len(json.dumps([t.spec() for t in choice.tools])) if choice else 0
    limit = front.server.max_prompt_chars
    if chars > limit:
        raise ApiError(400, f"{field} hold {chars} characters, more than the prompt limit's "
                            f"tokens can hold ({limit})", param=field)
    rendered, extra = tools.render(messages, choice, tools.takes_tools(tok.chat_template))
    try:
        return await front.server.off_loop(tok.apply_chat_template, rendered, tokenize=False,
                                           **extra, **template_options(front, body, messages))
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
        raise ApiError(400, f"the chat template refused the {field}: {e}",
                       param=field) from None


async def force_calls(front: Front, params: SamplingParams, choice: tools.ToolChoice) -> None:
    """tool_choice required or a named function: the output is a grammar's tool calls."""
    if params.structured_outputs is not None:
        raise ApiError(400, "tool_choice required or a named function cannot be combined "
                            "with structured output", param="tool_choice")
    params.structured_outputs = await grammar(front, {"grammar": choice.grammar()}, "tools")


async def after_reasoning(front: Front, params: SamplingParams) -> None:
    """Under a reasoning parser, structured output (forced tool calls too) constrains the
    answer only: the reasoning before it is free."""
    if front.reasoning is None or params.structured_outputs is None:
        return
    try:
        params.structured_outputs = await front.server.off_loop(
            reasoning.grammar_after, front.reasoning, params.structured_outputs,
            front.server.engine.tokenizer)
    except ValueError as e:
        raise ApiError(400, str(e), param="structured_outputs") from None


async def grammar(front: Front, spec: dict, field: str) -> dict:
    """`spec` compiled on the tokenizer thread (the engine finds it ready); a 400 naming
    the body's `field` if it does not compile."""
    if front.server.engine.grammars is not None:
        try:
            await front.server.off_loop(front.server.engine.grammars.check, spec)
        except ValueError as e:
            raise field_error(str(e), {"structured_outputs": field}) from None
    return spec
