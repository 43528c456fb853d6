"""Conversion of EAGLE-3 draft checkpoints between hf-eagle3's layouts and the formats of other projects.

Every format is read into one [`DraftCheckpoint`] (our config and weight names, validated once) and written from it:

| format | project | import | export |
|---|---|---|---|
| `hub` | hf-eagle3's own layout (`Eagle3DraftModel.save_pretrained(..., served_layout=False)`) | yes | yes |
| `official` | SafeAILab/EAGLE EAGLE-3 | yes | no |
| `sglang` | SpecForge / SGLang `LlamaForCausalLMEagle3` (what `save_pretrained` writes), AngelSlim's | yes | yes |
| `speculators` | vLLM / speculators `Eagle3Speculator` | yes | yes |
| `modelopt` | NVIDIA ModelOpt | yes | no |

```python
>>> from hf_eagle3.conversion import TargetInfo, convert
>>> convert("EAGLE3-LLaMA3.1-Instruct-8B", "draft", target=TargetInfo(num_hidden_layers=32))  # doctest: +SKIP
```
The command line is `hf-eagle3 convert SRC DST [--from FORMAT] [--to FORMAT]`; `Eagle3DraftModel.from_pretrained` reads
foreign folders through `foreign.read_foreign`, which `import hf_eagle3` registers with it. Where a format's engines
read a checkpoint differently, the reading chosen is recorded in the converted config (`converted_from["notes"]`);
what no reading makes faithful is refused.
"""

from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, ReadOptions, TargetInfo, UnknownFormatError
from .convert import EXPORT_FORMATS, FORMATS, convert, read_checkpoint, write_checkpoint

__all__ = [
    "EXPORT_FORMATS",
    "FORMATS",
    "CheckpointFormat",
    "ConversionError",
    "DraftCheckpoint",
    "ReadOptions",
    "TargetInfo",
    "UnknownFormatError",
    "convert",
    "read_checkpoint",
    "write_checkpoint",
]
