"""--plot: decode KLD (log) against capacity, the Pareto front marked,
no two labels overlapping (matplotlib, given by the caller)."""
import os


def pareto(points: list) -> list:
    """Indices of the points (capacity, kld) no other point beats: none has
    capacity >= and KLD <= with one of them strict."""
    front = []
    for i, (c, k) in enumerate(points):
        if not any((c2 >= c and k2 <= k) and (c2 > c or k2 < k)
                   for j, (c2, k2) in enumerate(points) if j != i):
            front.append(i)
    return front


LABEL_PT = 8        # label font size, points
PLOT_DPI = 120      # the figure's dots per inch, which the PNG keeps


def _label_offsets() -> list:
    """Where a label may go, in order of preference: (dx, dy) in points
    from its point, horizontal and vertical alignment, whether a leader
    line joins it to the point. Beside the point first (right, left, above,
    below), then in rings farther out, up and down, right and left."""
    near = [(6, 2, "left", "bottom"), (6, -2, "left", "top"),
            (-6, 2, "right", "bottom"), (-6, -2, "right", "top"),
            (0, 7, "center", "bottom"), (0, -7, "center", "top")]
    out = [(dx, dy, ha, va, False) for dx, dy, ha, va in near]
    for ring in range(1, 25):
        for dx in (16, 48):
            for sx, ha in ((1, "left"), (-1, "right")):
                for sy, va in ((1, "bottom"), (-1, "top")):
                    out.append((sx * dx, sy * (2 + 9 * ring), ha, va, True))
    return out


def _place_labels(fig, ax, pts: list, labels: list, order: list) -> list:
    """Annotate each point with its label where the label's box meets no
    other label's, no marker, no legend, and lies inside the axes: the first
    free place of _label_offsets() (a leader line to the far ones), labels
    placed in the given order. Where no place is free (more labels than
    room), the one overlapping least. Call after the axes' limits and
    layout are final: boxes are measured in the figure's pixels. Returns
    the annotations, one per point."""
    from matplotlib.transforms import Bbox
    fig.canvas.draw()
    rend = fig.canvas.get_renderer()
    axbox = ax.get_window_extent(rend)
    px = [ax.transData.transform(p) for p in pts]
    m = 4 * fig.dpi / 72            # a marker's half width, pixels
    taken = [Bbox.from_extents(x - m, y - m, x + m, y + m) for x, y in px]
    leg = ax.get_legend()
    if leg is not None:
        taken.append(leg.get_window_extent(rend))
    sizes = []
    for lab in labels:               # each label's box, pixels
        t = ax.text(0, 0, lab, fontsize=LABEL_PT)
        bb = t.get_window_extent(rend)
        sizes.append((bb.width, bb.height))
        t.remove()
    k = fig.dpi / 72
    anns = [None] * len(pts)
    for i in order:
        (x, y), (w, h) = px[i], sizes[i]
        best, best_cost = None, None
        for dx, dy, ha, va, lead in _label_offsets():
            ax0 = x + dx * k - {"left": 0, "right": w, "center": w / 2}[ha]
            ay0 = y + dy * k - {"bottom": 0, "top": h}[va]
            bb = Bbox.from_bounds(ax0 - 1, ay0 - 1, w + 2, h + 2)
            inside = (bb.x0 >= axbox.x0 and bb.x1 <= axbox.x1 and bb.y0 >= axbox.y0
                      and bb.y1 <= axbox.y1)
            over = sum(max(0, min(bb.x1, o.x1) - max(bb.x0, o.x0))
                       * max(0, min(bb.y1, o.y1) - max(bb.y0, o.y0)) for o in taken)
            cost = over + (0 if inside else w * h)
            if best_cost is None or cost < best_cost:
                best, best_cost = (dx, dy, ha, va, lead, bb), cost
            if cost == 0:
                break
        dx, dy, ha, va, lead, bb = best
        taken.append(bb)
        anns[i] = ax.annotate(labels[i], pts[i], xytext=(dx, dy), textcoords="offset points",
                              ha=ha, va=va, fontsize=LABEL_PT,
                              arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6,
                                              shrinkA=0, shrinkB=3) if lead else None)
    return anns


def figure(report: dict, plt):
    """The ladder's figure (matplotlib, PLOT_DPI dots per inch): each
    measured format's decode KLD mean (log) against its capacity (KV tokens
    x the reference's at --budget), labelled with no two labels' boxes
    overlapping (_place_labels); the Pareto front joined and marked.
    Formats with no positive KLD (the reference) cannot sit on a log axis
    and are left out. Returns the figure; its axes' texts are the labels."""
    pts, labels = [], []
    for f in report["formats"]:
        if f["status"] == "ok" and f["x_ref"] and f["decode_kld_mean"]:
            pts.append((f["x_ref"], f["decode_kld_mean"]))
            labels.append(f["label"])
    fig, ax = plt.subplots(figsize=(9, 6), dpi=PLOT_DPI)
    front = set(pareto(pts))
    for i, (c, k) in enumerate(pts):
        on = i in front
        ax.scatter([c], [k], marker="o" if on else "x", s=50 if on else 30,
                   color="C3" if on else "C0", zorder=3)
    fr = sorted(pts[i] for i in front)
    if fr:
        ax.plot([p[0] for p in fr], [p[1] for p in fr], color="C3", lw=1, ls="--",
                label="Pareto front (no format holds more with a lower KLD)")
        ax.legend(loc="lower left", fontsize=8)
    ax.set_yscale("log")
    ax.margins(x=0.2, y=0.25)        # room for the labels beside the outer points
    pool = "MLA tail pool" if report.get("mla") else "staging pool"
    ax.set_xlabel(f"capacity: KV tokens x auto's at {report['budget_bytes'] / 2**30:.2f} GiB "
                  f"({pool} counted)")
    ax.set_ylabel(f"decode KLD mean to auto (last {report['decode']} positions"
                  + (", folded top-20)" if report["kld_mode"] != "exact" else ")"))
    ax.set_title(f"{os.path.basename(os.path.normpath(report['model']))}: {report['windows']} x "
                 f"{report['ctx']} tokens, vLLM {report['vllm_version']} (reference: auto)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    ax.set_xlim(ax.get_xlim())       # the limits fixed before the labels are measured
    ax.set_ylim(ax.get_ylim())
    # the front first (the formats worth naming plainly), then by capacity
    order = sorted(range(len(pts)), key=lambda i: (i not in front, -pts[i][0]))
    _place_labels(fig, ax, pts, labels, order)
    return fig


def plot(report: dict, path: str, plt) -> None:
    """Write figure(report) to path as a PNG at PLOT_DPI."""
    fig = figure(report, plt)
    try:
        fig.savefig(path, dpi=PLOT_DPI)
    finally:
        plt.close(fig)
