"""`ninfer chat`: an interactive multi-turn chat in the terminal.

Enter sends; Esc then Enter (or Alt+Enter) inserts a new line. Ctrl-C while an answer streams
stops that answer and keeps the session; Ctrl-D or /exit leaves. When stdin is not a terminal,
each input line is one user turn (handy for scripts and tests).
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from ninfer.cli.common import (
    add_model_arguments, add_sampling_arguments, engine_config, runtime_options, sampling_params,
)  # fmt: skip

HELP = "commands: /reset clears the conversation, /system TEXT sets the system message, /exit leaves"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat", help="interactive terminal chat",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_model_arguments(parser, activations=True)
    parser.add_argument("--system", metavar="TEXT", help="initial system message")
    add_sampling_arguments(parser, max_tokens=512)
    parser.set_defaults(run=run)
    return parser


class Conversation:
    """The message history, rendered through the chat template for every turn."""

    def __init__(self, system: str | None):
        self.system = system
        self.messages: list[dict] = []

    def reset(self) -> None:
        self.messages.clear()

    def render(self, model) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        text = model.chat_template.render(head + self.messages, add_generation_prompt=True)
        return model.tokenizer.encode(text)


class LineReader:
    """Reads one user turn: prompt_toolkit on a terminal, plain lines otherwise."""

    def __init__(self):
        self.session = None
        if sys.stdin.isatty():
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import InMemoryHistory

            self.session = PromptSession(history=InMemoryHistory())

    def read(self) -> str | None:
        """The next turn, '' for a cancelled line, None at end of input."""
        if self.session is None:
            line = sys.stdin.readline()
            return None if not line else line.rstrip("\n")
        try:
            return self.session.prompt("> ", multiline=False, prompt_continuation="… ",
                                       enable_open_in_editor=False, key_bindings=_newline_bindings())
        except KeyboardInterrupt:
            return ""
        except EOFError:
            return None


def _newline_bindings():
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _(event):
        event.current_buffer.insert_text("\n")

    return bindings


async def answer(engine, model, conversation: Conversation, args) -> None:
    """Stream one answer; Ctrl-C (SIGINT) stops it and keeps what was said."""
    from ninfer.sched.request import GenerationRequest, TokenDelta

    request = GenerationRequest(
        prompt_ids=tuple(conversation.render(model)), max_tokens=args.max_tokens,
        sampling=sampling_params(args), seed=args.seed, stop=tuple(args.stop), request_id="chat",
    )  # fmt: skip
    parts: list[str] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_sigint, scope)
            async with engine.submit(request) as stream:
                async for event in stream:
                    if isinstance(event, TokenDelta):
                        parts.append(event.text)
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
            nursery.cancel_scope.cancel()
    if scope.cancelled_caught:
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    conversation.messages.append({"role": "assistant", "content": "".join(parts)})


async def _cancel_on_sigint(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


def handle_command(line: str, conversation: Conversation) -> bool:
    """Apply a /command; False when the user wants to leave."""
    name, _, rest = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        conversation.reset()
        print("(conversation cleared)")
    elif name == "/system":
        conversation.system = rest.strip() or None
        conversation.reset()
        print("(system message set; conversation cleared)")
    else:
        print(f"unknown command {name}; {HELP}")
    return True


async def chat(args: argparse.Namespace) -> int:
    from ninfer.cli.common import CliError
    from ninfer.runtime import load, open_runtime

    options, config = runtime_options(args), engine_config(args, max_concurrency=1)
    model = load(args.model, progress=True)
    if model.chat_template is None:
        raise CliError(f"model {model.name} has no chat template; use `ninfer generate --raw`")
    conversation = Conversation(args.system)
    reader = LineReader()
    async with open_runtime(model, options, config) as (engine, _, backend):
        print(f"{model.name} on {backend}. {HELP}; Ctrl-C stops an answer.", file=sys.stderr)
        while True:
            line = await trio.to_thread.run_sync(reader.read, abandon_on_cancel=True)
            if line is None:
                return 0
            if not line.strip():
                continue
            if line.startswith("/"):
                if not handle_command(line.strip(), conversation):
                    return 0
                continue
            conversation.messages.append({"role": "user", "content": line})
            await answer(engine, model, conversation, args)


def run(args: argparse.Namespace) -> int:
    return trio.run(chat, args)
