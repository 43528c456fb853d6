"""Code training data without generation: HumanEval-shaped tasks cut from Python source files.

Every function (or method) of a source tree that has a docstring becomes one chat: the user turn asks to complete it
and shows its signature and docstring the way the HumanEval prompts do (`resources.prompts.humaneval_prompts`); the
assistant turn is the function as written. Trained on with the target's own distribution as the label (the draft's
loss), such a chat teaches the draft what the target predicts inside code at prefill speed, with no regeneration.

`hf-eagle3 code-tasks --output tasks.jsonl` writes them from the Python standard library (PSF License) in a fixed
order, one chat-messages JSON line each, with the file and line they came from: the file is the exact record of what
was trained on, and `hf-eagle3 prepare-data --input tasks.jsonl` tokenizes it.
"""

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# directories of the standard library that hold tests, demos or vendored third-party code rather than library code
SKIPPED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                                 "lib2to3", "Tools", "turtledemo", "ensurepip"})
MAX_SOURCE_CHARS = 4000
MIN_BODY_LINES = 2


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | Path) -> list[Path]:
    """The `.py` files under `root`, sorted, outside test and vendored directories."""
    root = Path(root)
    return sorted(
        path for path in root.rglob("*.py")
        if not SKIPPED_DIRECTORIES.intersection(path.relative_to(root).parts[:-1])
    )


def _task(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, str, str] | None:
    """(first line, prompt stub, source) of one function: its decorators, signature and docstring, and its whole
    source, from the line of its first decorator."""
    docstring = ast.get_docstring(node, clean=False)
    if docstring is None or len(node.body) < MIN_BODY_LINES:
        return None
    first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)]) - 1
    docstring_end = node.body[0].end_lineno
    source = "".join(source_lines[first:node.end_lineno])
    indent = len(source_lines[first]) - len(source_lines[first].lstrip())
    if len(source) > MAX_SOURCE_CHARS or not source.isascii() or "\t" in source:
        return None
    stub = _dedent("".join(source_lines[first:docstring_end]), indent)
    return first + 1, stub, _dedent(source, indent)


def _dedent(text: str, indent: int) -> str:
    return "".join(line[indent:] if line.strip() else line for line in text.splitlines(True))


def function_tasks(path: str | Path) -> Iterator[tuple[int, str, str]]:
    """(line, prompt stub, function source) of every documented function of the Python file `path`, in file order
    (the line of its first decorator, else of its `def`); a file that does not parse yields nothing."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines(True)
    nodes = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(nodes, key=lambda node: node.lineno):
        task = _task(lines, node)
        if task is not None:
            yield task


def chat(stub: str, source: str) -> list[dict]:
    """The task as chat messages, the user turn shaped like the HumanEval prompts."""
    return [
        {"role": "user", "content": f"Complete the following Python function.\n\n```python\n{stub}```"},
        {"role": "assistant", "content": f"```python\n{source}```"},
    ]


def write_code_tasks(output: str | Path, roots: list[str | Path]) -> int:
    """Write the tasks of every source file under `roots` to the JSON-lines file `output` (atomically); returns how
    many."""
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    count = 0
    with partial.open("w") as file:
        for root in roots:
            for path in source_files(root):
                for line, stub, source in function_tasks(path):
                    where = f"{Path(path).relative_to(root).as_posix()}:{line}"
                    file.write(json.dumps({"source": where, "messages": chat(stub, source)}) + "\n")
                    count += 1
    partial.replace(output)
    return count


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "code-tasks",
        help="Write HumanEval-shaped code-completion chats cut from Python sources (default: the standard library).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", required=True, help="The chat-messages JSON-lines file to write.")
    parser.add_argument("--root", nargs="+", help="Source trees to read (default: this Python's standard library).")
    parser.set_defaults(run=_run_cli)


def _run_cli(args: argparse.Namespace) -> None:
    roots = [Path(root) for root in args.root] if args.root else [stdlib_root()]
    for root in roots:
        if not root.is_dir():
            raise SystemExit(f"--root {root} is not a directory.")
    count = write_code_tasks(args.output, roots)
    print(f"{count} code tasks from {', '.join(map(str, roots))} in {args.output}")


__all__ = ["chat", "function_tasks", "source_files", "stdlib_root", "write_code_tasks"]
