#!/usr/bin/python3
"""Write the small real graphs Debian ships as meshtrain edge lists.

Usage: scripts/graphs/debian_graphs.py OUT_DIR

From networkx (Debian's python3-networkx): OUT_DIR/karate.edges, Zachary's
karate club (34 members, 78 friendships; class = the club each member
joined after the split, the "club" attribute), and OUT_DIR/davis.edges, the
Davis Southern women graph (18 women and 14 events, an edge per attendance;
class = woman or event). From graph-tool's bundled collection (Debian's
python3-graph-tool), when it is installed: OUT_DIR/polblogs.edges (1,490
political blogs, links taken as undirected; class = the "value" leaning),
polbooks.edges (105 books; class = liberal / neutral / conservative) and
football.edges (115 college teams; class = the conference). Train on them
with data.graph = "edges" and data.graph_file = the file
(docs/graph_format.md, "Edge lists"); features are one-hot vertex ids.
"""

import pathlib
import sys

import networkx as nx


def write(path, graph, label_of, classes, what):
    ids = {v: i for i, v in enumerate(graph.nodes())}
    with open(path, "w") as f:
        f.write(f"# {what}, written by scripts/graphs/debian_graphs.py from networkx "
                f"{nx.__version__}\n")
        f.write(f"vertices {len(ids)} classes {classes}\n")
        for v, i in ids.items():
            f.write(f"label {i} {label_of(v)}\n")
        for u, v in graph.edges():
            f.write(f"edge {ids[u]} {ids[v]}\n")
    print(f"{path}: {len(ids)} vertices, {graph.number_of_edges()} edges, {classes} classes")


def write_graph_tool(out):
    try:
        import graph_tool.collection as collection
    except ImportError:
        print("graph-tool not installed (Debian: python3-graph-tool): no polblogs, polbooks, "
              "football")
        return
    for name in ("polblogs", "polbooks", "football"):
        g = collection.data[name]
        value = g.vp["value"]
        kinds = sorted({value[v] for v in g.vertices()})
        index = {k: i for i, k in enumerate(kinds)}
        path = out / f"{name}.edges"
        with open(path, "w") as f:
            f.write(f"# {name} from graph-tool's collection; class = its 'value' property "
                    f"({', '.join(str(k) for k in kinds)}), written by "
                    f"scripts/graphs/debian_graphs.py\n")
            f.write(f"vertices {g.num_vertices()} classes {len(kinds)}\n")
            for v in g.vertices():
                f.write(f"label {int(v)} {index[value[v]]}\n")
            for e in g.edges():
                f.write(f"edge {int(e.source())} {int(e.target())}\n")
        print(f"{path}: {g.num_vertices()} vertices, {g.num_edges()} edges, {len(kinds)} classes")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    karate = nx.karate_club_graph()
    clubs = sorted({karate.nodes[v]["club"] for v in karate})
    write(out / "karate.edges", karate, lambda v: clubs.index(karate.nodes[v]["club"]), 2,
          "Zachary's karate club; class = " + " / ".join(clubs))
    davis = nx.davis_southern_women_graph()
    write(out / "davis.edges", davis, lambda v: davis.nodes[v]["bipartite"], 2,
          "Davis Southern women; class 0 = woman, 1 = event")
    write_graph_tool(out)


if __name__ == "__main__":
    main()
