//! PipeDream's profiles: the `graph.txt` its profiler writes, read into the planner's chain.
//!
//! The format, one line each:
//!
//! ```text
//! node4 -- Conv2d(64, 64, kernel_size=(3, 3)) -- forward_compute_time=46.201, backward_compute_time=113.330, activation_size=1644167168.000, parameter_size=147712.000
//! \tnode3 -- node4
//! ```
//!
//! A node line gives an id, a description and the node's measurements for one minibatch of the
//! profiled batch (times in milliseconds, sizes in bytes); PipeDream's optimizer appends
//! `-- stage_id=N` to the nodes of a partitioned graph. An edge line, indented, says the second
//! node consumes the first's output.
//!
//! The runtime sends one tensor across a stage boundary, so a graph can only be cut where one
//! node's output is all that crosses: between layers of a chain, and between the blocks of a
//! residual network but not inside them. [`Graph::chain`] merges the nodes between two such
//! cuts into one planner unit ([`Segment`]).

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::cost::{LayerCost, MAX_LAYER_BYTES, MAX_LAYER_SECONDS};

/// One node of PipeDream's graph.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphNode {
    pub id: String,
    pub description: String,
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// Bytes of the node's output.
    pub activation_bytes: f64,
    pub param_bytes: f64,
    /// The stage PipeDream's optimizer gave it, in a partitioned graph.
    pub stage_id: Option<usize>,
}

/// PipeDream's profile graph, nodes in the file's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub nodes: Vec<GraphNode>,
    /// `(producer, consumer)` as indices into `nodes`.
    pub edges: Vec<(usize, usize)>,
}

/// A graph that cannot be read or planned over; `line` is 1-based, 0 for the graph as a whole.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}{reason}", if *.line > 0 { format!("line {line}: ") } else { String::new() })]
pub struct GraphError {
    pub line: usize,
    pub reason: String,
}

fn error(line: usize, reason: impl Into<String>) -> GraphError {
    GraphError {
        line,
        reason: reason.into(),
    }
}

/// The nodes between two cuts the runtime can make, as one unit for the planner.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Indices into [`Graph::nodes`], in topological order.
    pub nodes: Vec<usize>,
    /// Its costs for one minibatch of the profiled batch: times summed, the activations all its
    /// nodes keep, the one output that crosses a cut after it, no optimizer time (PipeDream's
    /// profiler does not measure it).
    pub cost: LayerCost,
}

const KEYS: [&str; 4] = [
    "forward_compute_time",
    "backward_compute_time",
    "activation_size",
    "parameter_size",
];

fn parse_node(text: &str, line: usize) -> Result<GraphNode, GraphError> {
    let parts: Vec<&str> = text.split(" -- ").collect();
    let measured = parts
        .iter()
        .position(|p| p.trim_start().starts_with("forward_compute_time="))
        .ok_or_else(|| {
            error(
                line,
                "a node needs its measurements (`-- forward_compute_time=..., backward_compute_time=..., activation_size=..., parameter_size=...`)",
            )
        })?;
    if measured < 2 {
        return Err(error(
            line,
            "a node line is `<id> -- <description> -- <measurements>`",
        ));
    }
    let mut values = HashMap::new();
    for field in parts[measured].split(',') {
        let (key, value) = field
            .trim()
            .split_once('=')
            .ok_or_else(|| error(line, format!("`{}` is not key=value", field.trim())))?;
        let text = value;
        let value: f64 = text
            .trim()
            .parse()
            .map_err(|_| error(line, format!("{key}: `{}` is not a number", text.trim())))?;
        // Times in milliseconds, sizes in bytes, bounded as the runtime's profiles are.
        let (most, allowed) = match key.ends_with("_time") {
            true => (
                MAX_LAYER_SECONDS * 1e3,
                "milliseconds from 0 to 1e9 (eleven and a half days)",
            ),
            false => (MAX_LAYER_BYTES, "bytes from 0 to 2^50 (a pebibyte)"),
        };
        if !(0.0..=most).contains(&value) {
            return Err(error(
                line,
                format!(
                    "{key} is `{}`; it must be a finite number of {allowed}",
                    text.trim()
                ),
            ));
        }
        values.insert(key, value);
    }
    let get = |key: &str| {
        values
            .get(key)
            .copied()
            .ok_or_else(|| error(line, format!("the node has no {key}")))
    };
    let mut stage_id = None;
    for extra in &parts[measured + 1..] {
        let value = extra.trim().strip_prefix("stage_id=").ok_or_else(|| {
            error(
                line,
                format!("`{}` after the measurements is not stage_id=N", extra.trim()),
            )
        })?;
        stage_id = Some(
            value
                .parse()
                .map_err(|_| error(line, format!("stage_id: `{value}` is not a stage number")))?,
        );
    }
    Ok(GraphNode {
        id: parts[0].trim().to_string(),
        description: parts[1..measured].join(" -- "),
        forward_ms: get(KEYS[0])?,
        backward_ms: get(KEYS[1])?,
        activation_bytes: get(KEYS[2])?,
        param_bytes: get(KEYS[3])?,
        stage_id,
    })
}

impl Graph {
    /// Reads PipeDream's `graph.txt`.
    pub fn parse(text: &str) -> Result<Graph, GraphError> {
        let mut nodes = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut pending = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            if raw.starts_with(char::is_whitespace) {
                let (from, to) = raw
                    .trim()
                    .split_once(" -- ")
                    .ok_or_else(|| error(line, "an edge line is `\\t<node> -- <node>`"))?;
                pending.push((line, from.trim().to_string(), to.trim().to_string()));
                continue;
            }
            let node = parse_node(raw, line)?;
            if index.insert(node.id.clone(), nodes.len()).is_some() {
                return Err(error(line, format!("{} is declared twice", node.id)));
            }
            nodes.push(node);
        }
        let mut edges = Vec::new();
        for (line, from, to) in pending {
            let find = |id: &str| {
                index
                    .get(id)
                    .copied()
                    .ok_or_else(|| error(line, format!("the edge names {id}, which no node line declares")))
            };
            edges.push((find(&from)?, find(&to)?));
        }
        if nodes.is_empty() {
            return Err(error(
                0,
                "the graph has no nodes (is this PipeDream's graph.txt?)",
            ));
        }
        Ok(Graph { nodes, edges })
    }

    /// The nodes in an order where every producer comes before its consumers; among the nodes
    /// ready at once, the file's order.
    pub fn topological_order(&self) -> Result<Vec<usize>, GraphError> {
        let n = self.nodes.len();
        let mut waiting = vec![0usize; n];
        let mut consumers = vec![Vec::new(); n];
        for &(from, to) in &self.edges {
            waiting[to] += 1;
            consumers[from].push(to);
        }
        let mut ready: std::collections::BTreeSet<usize> = (0..n).filter(|&i| waiting[i] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(next) = ready.pop_first() {
            order.push(next);
            for &c in &consumers[next] {
                waiting[c] -= 1;
                if waiting[c] == 0 {
                    ready.insert(c);
                }
            }
        }
        if order.len() < n {
            let stuck = (0..n).find(|&i| waiting[i] > 0).expect("some node waits");
            return Err(error(
                0,
                format!("the graph has a cycle through {}", self.nodes[stuck].id),
            ));
        }
        Ok(order)
    }

    /// The graph as a chain of [`Segment`]s, cut wherever one node's output is all that crosses.
    pub fn chain(&self) -> Result<Vec<Segment>, GraphError> {
        let order = self.topological_order()?;
        let n = order.len();
        let mut position = vec![0; n];
        for (p, &node) in order.iter().enumerate() {
            position[node] = p;
        }
        // Each node's output is live from its position until its last consumer's.
        let mut last_use = vec![None; n];
        for &(from, to) in &self.edges {
            let p = position[to];
            last_use[from] = Some(last_use[from].map_or(p, |q: usize| q.max(p)));
        }
        let mut segments = Vec::new();
        let mut current = Vec::new();
        for (p, &node) in order.iter().enumerate() {
            current.push(node);
            if p + 1 == n {
                break;
            }
            let mut crossing = order[..=p]
                .iter()
                .filter(|&&i| last_use[i].is_some_and(|last| last > p));
            let (Some(&only), None) = (crossing.next(), crossing.next()) else {
                continue;
            };
            segments.push(self.segment(std::mem::take(&mut current), self.nodes[only].activation_bytes));
        }
        segments.push(self.segment(current, 0.0));
        Ok(segments)
    }

    fn segment(&self, nodes: Vec<usize>, output_bytes: f64) -> Segment {
        let sum = |f: fn(&GraphNode) -> f64| nodes.iter().map(|&i| f(&self.nodes[i])).sum::<f64>();
        let cost = LayerCost {
            compute_s: sum(|n| n.forward_ms + n.backward_ms) / 1e3,
            activation_bytes: sum(|n| n.activation_bytes),
            output_bytes,
            param_bytes: sum(|n| n.param_bytes),
            optimizer_s: 0.0,
        };
        Segment { nodes, cost }
    }

    /// The graph in PipeDream's format, each node given `stage_of[node]` as its `stage_id`: what
    /// PipeDream's optimizer writes for its `convert_graph_to_model.py`.
    pub fn with_stages(&self, stage_of: &[usize]) -> String {
        let mut out = String::new();
        for (node, stage) in self.nodes.iter().zip(stage_of) {
            let _ = writeln!(
                out,
                "{} -- {} -- forward_compute_time={:.3}, backward_compute_time={:.3}, activation_size={:.3}, parameter_size={:.3} -- stage_id={stage}",
                node.id, node.description, node.forward_ms, node.backward_ms, node.activation_bytes, node.param_bytes
            );
        }
        for &(from, to) in &self.edges {
            let _ = writeln!(out, "\t{} -- {}", self.nodes[from].id, self.nodes[to].id);
        }
        out
    }
}
