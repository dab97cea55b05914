"""What a step costs against its rows, learned online from the engine's own steps: the speculative rule's price of a
verification row (engine.core.speculative.plan_lengths) and of a draft model's token (engine.draft). No torch."""

from __future__ import annotations


class StepCost:
    """A step's time against its rows, learned online: each row count's mean time (older steps forgotten
    geometrically), and around any row count a line, fixed + per_row x rows, fitted by least squares to the counts
    near it (half to twice it, plus two). A CPU step is not one line: at one or two rows it reads the weights and
    the rows ride along (memory-bound), from a few rows on each row's arithmetic is the cost (compute-bound: on a
    small model that is from three rows); one line through all counts priced a row at 16 streams at 80% of its
    cost. The line near a step's own rows prices what its proposals add. Where fewer than two row counts lie near,
    the line through all of them. Before the rows vary enough to fit, rows are assumed to cost `prior` of the
    fixed part (a pseudo-point eight rows above the first step). Where the steps of as many decodes had proposals
    that varied, those steps alone price a proposed row (`proposal_rows`, `prices`)."""

    def __init__(self, decay: float = 0.98, prior: float = 0.3) -> None:
        self.decay = decay
        self.prior = prior
        self._steps = 0
        self._rows: dict[int, list[float]] = {}  # rows -> [weight, weighted seconds, step of the last update]
        self._fits: dict[int | None, tuple[float, float]] = {}  # since the last step observed
        # decodes -> weighted sums of the steps with that many decodes: [w, extra rows, seconds, extra rows squared,
        # extra rows x seconds, step of the last update]
        self._split: dict[int, list[float]] = {}

    def observe(self, rows: int, seconds: float, decodes: int | None = None) -> None:
        """A step of `rows` rows took `seconds`; `decodes` of the rows were the decoding sequences' own (the rest:
        proposals verified), where the caller knows."""
        if not self._rows:  # a pseudo-point that says: each row costs `prior` of the fixed part
            fixed = seconds / (1 + self.prior * rows)
            self._add(rows + 8, fixed * (1 + self.prior * (rows + 8)))
        self._add(rows, seconds)
        if decodes is not None:
            extra = float(rows - decodes)
            found = self._split.setdefault(decodes, [0.0] * 5 + [float(self._steps)])
            aged = self.decay ** (self._steps - found[5])
            for i, v in enumerate((1.0, extra, seconds, extra * extra, extra * seconds)):
                found[i] = aged * found[i] + v
            found[5] = self._steps

    def proposal_rows(self, decodes: int) -> tuple[float, float] | None:
        """(a step's seconds without proposals, seconds a proposed row adds) among the steps of exactly `decodes`
        decoding sequences: the least-squares line of their time against the rows proposals added (older steps
        forgotten). Unlike the line across row counts, the decodes' own rows (and, in one wave, how deep in their
        contexts they are) stay the same along it: after the grounded mix at one stream the line near one row priced
        a proposed row at 0.55 ms where these steps said 0.83 (docs/speculative.md). None until proposals there
        varied by at least a row (variance of 1) over 8 steps' weight, or where the slope comes out at or below 0."""
        found = self._split.get(decodes)
        if found is None or found[0] < 8.0:
            return None
        w, sx, sy, sxx, sxy, _ = found
        var = sxx / w - (sx / w) ** 2
        if var < 1.0:
            return None
        slope = (sxy / w - sx / w * sy / w) / var
        if slope <= 0.0:
            return None
        return (sy - slope * sx) / w, slope

    def _add(self, x: int, y: float) -> None:
        self._steps += 1
        self._fits.clear()
        found = self._rows.get(x)
        if found is None:
            self._rows[x] = [1.0, y, self._steps]
            return
        aged = self.decay ** (self._steps - found[2])
        found[0], found[1], found[2] = aged * found[0] + 1, aged * found[1] + y, self._steps

    def fit(self, rows: int | None = None) -> tuple[float, float]:
        """(fixed, per_row) seconds of the line near `rows` (through every row count when None); (0, 0) before
        any step."""
        found = self._fits.get(rows)
        if found is None:
            found = self._fits[rows] = self._fit(rows)
        return found

    def _fit(self, rows: int | None) -> tuple[float, float]:
        points = [(x, w * self.decay ** (self._steps - t), y / w) for x, (w, y, t) in self._rows.items()]
        if rows is not None:
            near = [p for p in points if rows / 2 <= p[0] <= 2 * rows + 2]
            points = near if len(near) >= 2 else points
        if not points:
            return 0.0, 0.0
        sw = sum(w for _, w, _ in points)
        mx, my = sum(w * x for x, w, _ in points) / sw, sum(w * y for _, w, y in points) / sw
        var = sum(w * (x - mx) ** 2 for x, w, _ in points) / sw
        cov = sum(w * (x - mx) * (y - my) for x, w, y in points) / sw
        per_row = max(0.0, cov / var) if var > 1e-9 else 0.0
        fixed = my - per_row * mx
        if fixed <= 0.05 * my:  # noise, or a line steeper than its own mean: keep a fixed part
            fixed = 0.05 * my
            per_row = (my - fixed) / max(mx, 1.0)
        return fixed, per_row

    def prices(self, rows: int) -> tuple[float, float]:
        """(seconds a step of `rows` decodes takes, seconds a proposed row adds to it): `proposal_rows` where the
        steps of that many decodes say; else the line near `rows`, a proposed row priced by the steps of the nearest
        count of decodes (one or two away) that say, where one does (0, 0 before any step). A wave's decodes fall
        one by one, each count new to the price, and the line near them holds one stream's verifications (many rows
        of one sequence): open chat's first 16-stream wave after one stream ran 0.91-0.97x plain priced by the line,
        0.99-1.01x priced by the neighbour (docs/speculative.md, "A new count of decodes")."""
        split = self.proposal_rows(rows)
        if split is not None:
            return split
        fixed, per_row = self.fit(rows)
        near = next((found for d in (rows - 1, rows + 1, rows - 2, rows + 2)
                     if d > 0 and (found := self.proposal_rows(d)) is not None), None)
        return fixed + per_row * rows, per_row if near is None else near[1]

    def step_time(self, rows: int) -> float:
        """Seconds a step of `rows` decodes takes (0 before any step)."""
        return self.prices(rows)[0]

    def row_share(self, rows: int, extra: float = 0.0) -> float:
        """(a proposed row's seconds + extra) x rows / a step's seconds, at `rows` decodes (`prices`): a proposed
        row's cost over what decoding yields a token for, a row costing `extra` seconds more elsewhere (a draft
        model's token) (prior before data)."""
        step, per_row = self.prices(rows)
        if step == 0.0:
            return self.prior * rows / (1 + self.prior * rows)
        return (per_row + extra) * rows / step
