"""`hf-eagle3 code-tasks`: HumanEval-shaped chats cut from Python sources, readable by prepare-data."""

import json

from hf_eagle3.commands.cli import main
from hf_eagle3.resources.prompts import humaneval_prompts
from hf_eagle3.training.code_tasks import chat, function_tasks, source_files
from hf_eagle3.training.data import read_conversations

MODULE = '''import math


def documented(x, y=2):
    """Return x to the power y."""
    z = x ** y
    return z


def undocumented(x):
    return x


class Shape:
    @property
    def area(self):
        """The area, in square units."""
        side = self.side
        return side * side
'''


def test_documented_functions_and_methods_become_tasks_whose_prompt_stops_after_the_docstring(tmp_path):
    path = tmp_path / "module.py"
    path.write_text(MODULE)
    tasks = list(function_tasks(path))
    assert [(line, stub.splitlines()[0]) for line, stub, _ in tasks] == [(4, "def documented(x, y=2):"),
                                                                          (15, "@property")]
    line, stub, source = tasks[1]
    assert stub == '@property\ndef area(self):\n    """The area, in square units."""\n'  # dedented, decorator kept
    assert source == stub + "    side = self.side\n    return side * side\n"


def test_the_user_turn_is_shaped_like_the_humaneval_prompts():
    prompt = humaneval_prompts()[0]
    stub = prompt.split("```python\n", 1)[1].removesuffix("```")
    assert chat(stub, stub + "    pass\n")[0]["content"] == prompt


def test_code_tasks_writes_a_chat_file_that_prepare_data_reads_with_where_each_task_came_from(tmp_path, capsys):
    root = tmp_path / "src"
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "module.py").write_text(MODULE)
    (root / "pkg" / "tests" / "test_module.py").write_text(MODULE)  # test directories are left out
    (root / "broken.py").write_text("def (:\n")  # does not parse: no task
    assert source_files(root) == [root / "broken.py", root / "pkg" / "module.py"]
    output = tmp_path / "tasks.jsonl"
    main(["code-tasks", "--output", str(output), "--root", str(root)])
    assert "2 code tasks" in capsys.readouterr().out
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [record["source"] for record in records] == ["pkg/module.py:4", "pkg/module.py:15"]
    conversations = list(read_conversations(output))
    assert [message["role"] for message in conversations[0]] == ["user", "assistant"]
    assert conversations[0][1]["content"].startswith("```python\ndef documented(x, y=2):")
