"""Table rows waiting on local disk for the next table write, not in memory (:class:`TableSpool`)."""

from __future__ import annotations

import bisect
import json
import math
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


class TableSpool:
    """One table artifact whose rows wait in a JSON-lines file on local disk, not in memory.

    MLflow's ``MlflowClient.log_table`` appends to an existing table by downloading it, reading it
    into pandas, concatenating the new rows and rewriting it (mlflow 3.x
    ``mlflow/tracking/client.py``), so every write holds the whole table in memory and a long
    run's peak memory grows with the table. Here :meth:`add` appends rows to ``<dir>/<name>.rows``
    and :meth:`export` streams them, one row in memory at a time, into the file ``log_table``
    would write: pandas' ``orient="split"`` JSON, ``{"columns": [...], "data": [[...], ...]}``
    (non-finite numbers as ``null``, as pandas writes them), read back by ``pandas.read_json(...,
    orient="split")`` and ``MlflowClient.load_table``.

    Columns are fixed by the first rows; a column first seen later is appended at the end and
    the earlier rows read ``null`` there (what pandas' concat gives).

    Args:
        directory: where the spool file lives (created if needed).
        name: the table's artifact file name, e.g. ``fp8_tensor_stats.json``.
        columns: the columns, if known before the first row.
    """

    def __init__(self, directory: str | Path, name: str, columns: Sequence[str] = ()) -> None:
        self.name = name
        self.path = Path(directory) / f"{name}.rows"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = list(columns)
        self.rows = 0  # rows in the spool
        self.written = 0  # rows in the spool when the last export was logged
        # (first row, width): rows from `first` on were added with `width` columns. Columns only
        # grow, so this holds one entry per widening; full-width rows are exported as stored.
        self._widths: list[tuple[int, int]] = []

    @property
    def unwritten(self) -> int:
        """Rows added since the last logged export."""
        return self.rows - self.written

    def add_columns(self, names: Iterable[str]) -> None:
        """Append the names not yet in :attr:`columns`."""
        self.columns.extend(n for n in dict.fromkeys(names) if n not in self.columns)

    def add(self, rows: Iterable[Sequence[Any]]) -> None:
        """Append rows (values in :attr:`columns` order; a shorter row reads ``null`` at the end)."""
        lines = [json.dumps([_json_value(v) for v in row]) + "\n" for row in rows]
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(lines)
        if not self._widths or self._widths[-1][1] != len(self.columns):
            self._widths.append((self.rows, len(self.columns)))
        self.rows += len(lines)

    def prepend(self, table: Mapping[str, Any]) -> None:
        """Put the rows of an existing table (``{"columns", "data"}``, e.g. the artifact of the run
        being resumed) before the spooled rows, matched to :attr:`columns` by name."""
        self.add_columns(table.get("columns", []))
        index = [self.columns.index(c) for c in table.get("columns", [])]
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as out:
            n = 0
            for values in table.get("data", []):
                row: list[Any] = [None] * len(self.columns)
                for i, v in zip(index, values, strict=False):
                    row[i] = _json_value(v)
                out.write(json.dumps(row) + "\n")
                n += 1
            if self.path.exists():
                with self.path.open(encoding="utf-8") as src:
                    shutil.copyfileobj(src, out)
        tmp.replace(self.path)
        self._widths = [
            (0, 0),
            *((first + n, w) for first, w in self._widths),
        ]  # prepended rows: parsed on export
        self.rows += n
        self.written += n

    def _lines(self, start: int = 0) -> Iterable[tuple[str, bool]]:
        """``(line, full_width)`` of the spooled rows from row ``start`` on."""
        if not self.path.exists():
            return
        width, bounds = len(self.columns), [first for first, _ in self._widths[1:]]
        with self.path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= start:
                    segment = bisect.bisect_right(bounds, i)
                    yield line.rstrip("\n"), bool(self._widths) and self._widths[segment][1] == width

    def iter_rows(self, start: int = 0) -> Iterable[list[Any]]:
        """The spooled rows from row ``start`` on, padded to :attr:`columns`."""
        width = len(self.columns)
        for line, _ in self._lines(start):
            row = json.loads(line)
            yield row + [None] * (width - len(row))

    def export(self, directory: str | Path) -> Path:
        """Write ``<directory>/<name>`` (the whole table, split JSON) and return its path."""
        width = len(self.columns)
        out_path = Path(directory) / self.name
        with out_path.open("w", encoding="utf-8") as out:
            out.write('{"columns":' + json.dumps(self.columns) + ',"data":[')
            for i, (line, full) in enumerate(self._lines()):
                if not full:  # added before a column was: pad it
                    row = json.loads(line)
                    line = json.dumps(row + [None] * (width - len(row)))
                out.write("," + line if i else line)
            out.write("]}")
        return out_path


def _json_value(v: Any) -> Any:
    """``v`` as pandas' ``to_json`` writes it: non-finite floats become ``null``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
