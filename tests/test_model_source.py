"""`--model package.module:callable` and `--model path/file.py:callable`: the network, or one line why not."""

import re
from pathlib import Path

import pytest
from torch import nn

from dimd.errors import DimdError
from dimd.train.model_source import build_user_model, is_model_spec, model_source

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_loop.py"


def test_a_file_and_its_callable_build_the_network():
    model = build_user_model(f"{EXAMPLE}:small_cnn", 7)
    assert isinstance(model, nn.Module) and model[-1].out_features == 7
    source = model_source(f"{EXAMPLE}:small_cnn")
    assert source["path"] == str(EXAMPLE) and len(source["sha256"]) == 64


def test_a_module_on_the_path_and_its_callable_build_the_network(tmp_path, monkeypatch):
    (tmp_path / "my_nets.py").write_text("from torch import nn\n"
                                         "def tiny(num_classes):\n    return nn.Linear(4, num_classes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_user_model("my_nets:tiny", 3).out_features == 3
    assert is_model_spec("my_nets:tiny") and not is_model_spec("resnet20")


@pytest.mark.parametrize("source, spec, message", [
    (None, "missing.py:build", "missing.py: no such file"),
    ("def other(num_classes):\n    pass\n", "FILE:build", "has no callable 'build'; it defines other"),
    ("build = 3\n", "FILE:build", "int (not callable) 'build'"),
    ("raise RuntimeError('no GPU here')\n", "FILE:build", "raised RuntimeError while loading: no GPU here"),
    ("def build(num_classes):\n    raise ValueError('bad width')\n", "FILE:build",
     "num_classes=5 raised ValueError: bad width"),
    ("def build(num_classes):\n    return [num_classes]\n", "FILE:build", "returned list, not a torch.nn.Module"),
    ("import sys\nsys.exit(0)\n", "FILE:build", "net.py called sys.exit(0) while loading"),
    ("def build(num_classes):\n    raise SystemExit\n", "FILE:build", "num_classes=5 called sys.exit()"),
    (None, "no_such_package.nets:build", "no module named 'no_such_package'"),
    (None, "file.py:", "expected package.module:callable"),
])
def test_a_bad_model_spec_is_one_line(tmp_path, source, spec, message):
    """Even a clean exit while it loads or builds (a script's sys.exit(0)) is an error: no run trained."""
    path = tmp_path / "net.py"
    if source is not None:
        path.write_text(source)
    spec = spec.replace("FILE", str(path)).replace("missing.py", str(tmp_path / "missing.py"))
    with pytest.raises(DimdError, match=re.escape(message)) as caught:
        build_user_model(spec, 5)
    assert "\n" not in str(caught.value)
