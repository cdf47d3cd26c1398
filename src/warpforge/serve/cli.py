"""``warpforge serve``: the command's body (the click options live in warpforge.cli)."""

from __future__ import annotations

from pathlib import Path

import click


def cli_serve(model: str, *, chat_template: str | None, **settings) -> int:
    """Check the settings, bind, load, serve; -> exit status (2: bad input, said in one line on stderr)."""
    def fail(msg: str) -> int:
        click.echo(f"warpforge serve: {msg}", err=True)
        return 2

    try:
        import fastapi  # noqa: F401 - the serve extra, checked before anything slow
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401

        from warpforge.serve.config import ServeConfig
        from warpforge.serve.server import bind, serve

        template = None
        if chat_template is not None:
            path = Path(chat_template)
            if not path.is_file():
                return fail(f"--chat-template: no such file: {chat_template!r} (expected a jinja template file)")
            template = path.read_text()
        config = ServeConfig(model=model, chat_template=template, **settings)
        sock = bind(config.host, config.port)  # before the load: a taken port fails now, not in a minute
    except ModuleNotFoundError as e:
        return fail(f"{e.name} is missing: install the serve extra (pip install 'warpforge[serve]')")
    except (ValueError, OSError) as e:
        return fail(str(e))
    try:
        from warpforge.serve.engine_client import EngineStartError
        from warpforge.serve.server import build_llm

        llm = build_llm(config)
    except ModuleNotFoundError as e:
        sock.close()
        return fail(f"{e.name} is missing: install the llm extra (pip install 'warpforge[llm]')")
    except (ValueError, FileNotFoundError, EngineStartError) as e:
        sock.close()
        return fail(str(e))
    return serve(config, llm=llm, sock=sock)
