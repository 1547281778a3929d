"""LinearProgram: a mixed-integer linear program as pure data, with an LP-format dump."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Row:
    """lower <= sum(coef * x[index]) <= upper; `family` names the constraint family."""

    indices: list[int]
    coefs: list[float]
    lower: float
    upper: float
    family: str


@dataclass(slots=True)
class LinearProgram:
    """minimize offset + cost . x subject to rows and bounds; some x integer."""

    names: list[str] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    offset: float = 0.0

    @property
    def num_vars(self) -> int:
        return len(self.names)

    @property
    def num_integer(self) -> int:
        return sum(self.integer)

    def add_var(self, name: str, cost: float = 0.0, lower: float = 0.0, upper: float = 1.0,
                integer: bool = False) -> int:
        self.names.append(name)
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.names) - 1

    def add_row(self, terms: dict[int, float], lower: float, upper: float, family: str) -> None:
        terms = {i: c for i, c in terms.items() if c != 0.0}
        self.rows.append(Row(list(terms), list(terms.values()), lower, upper, family))

    def to_lp_text(self) -> str:
        """The program in CPLEX LP format, for `--dump-lp` and for reading by other solvers."""

        def expr(indices, coefs):
            pairs = zip(indices, coefs, strict=True)
            parts = [f"{'-' if c < 0 else '+'} {abs(c):.12g} {self.names[i]}" for i, c in pairs]
            return " ".join(parts) if parts else "0 " + (self.names[0] if self.names else "")

        lines = ["\\ meshplan intra-op ILP", f"\\ objective offset {self.offset:.12g}", "Minimize",
                 " obj: " + expr(range(self.num_vars), self.cost), "Subject To"]
        for k, row in enumerate(self.rows):
            body = expr(row.indices, row.coefs)
            if row.lower == row.upper:
                lines.append(f" {row.family}_{k}: {body} = {row.lower:.12g}")
                continue
            if row.lower > float("-inf"):
                lines.append(f" {row.family}_{k}_lo: {body} >= {row.lower:.12g}")
            if row.upper < float("inf"):
                lines.append(f" {row.family}_{k}_hi: {body} <= {row.upper:.12g}")
        lines.append("Bounds")
        for i, name in enumerate(self.names):
            if not self.integer[i]:
                upper = "+inf" if self.upper[i] == float("inf") else f"{self.upper[i]:.12g}"
                lines.append(f" {self.lower[i]:.12g} <= {name} <= {upper}")
        binaries = [n for n, integer in zip(self.names, self.integer, strict=True) if integer]
        if binaries:
            lines += ["Binaries", " " + " ".join(binaries)]
        lines.append("End")
        return "\n".join(lines) + "\n"
