//! `tessera topology check FILE`: validates a topology file, reads the config of every model
//! it names, and prints each group's plan (which rank holds which heads and rows), or every
//! problem with its line and a sentence saying what to change.
//!
//! Exit status: 0 when the file is usable (warnings allowed), 1 when any error was found or
//! the file cannot be read. A model whose files are not on this machine is a warning — the
//! checks that need its config are skipped and say so — unless `--strict` makes every
//! warning an error. Diagnostics go to stderr, the plan to stdout; `--json` prints one JSON
//! document with both to stdout.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use serde_json::{Value, json};
use tessera_model::ModelConfig;
use tessera_topology::{
    CollectiveChoice, Group, ModelShape, RankPlan, Severity, Topology, TopologyError,
    TopologyIssue, format_size,
};

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The topology file.
    pub file: PathBuf,
    /// Print the plan and the issues as one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
    /// Treat warnings (such as a model whose files are not on this machine) as errors.
    #[arg(long)]
    pub strict: bool,
}

/// Runs the check, printing to stdout and stderr.
pub fn check(args: &CheckArgs) -> anyhow::Result<ExitCode> {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let ok = check_to(args, &mut stdout.lock(), &mut stderr.lock())?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs the check, printing the plan to `out` and diagnostics to `diag`. Returns whether
/// the topology is usable; `Err` only when the file cannot be read or output fails.
pub fn check_to(
    args: &CheckArgs,
    out: &mut dyn Write,
    diag: &mut dyn Write,
) -> anyhow::Result<bool> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read topology file {}", args.file.display()))?;
    let report = match Topology::parse(&text, &args.file) {
        Ok(topology) => Report::new(topology, args.strict),
        Err(issues) => Report::failed(issues, args.strict),
    };
    if args.json {
        let document = report.json(&args.file);
        serde_json::to_writer_pretty(&mut *out, &document)?;
        writeln!(out)?;
    } else {
        report.print_issues(&args.file, diag)?;
        if let (true, Some(topology)) = (report.ok(), &report.topology) {
            out.write_all(plan_text(&args.file, topology, &report.models).as_bytes())?;
        }
    }
    Ok(report.ok())
}

/// What was learned about one model of the topology.
#[derive(Debug)]
enum ModelStatus {
    Shape(ModelShape),
    Missing,
    Unreadable,
}

/// The validated topology (when it is one), the model statuses, and every issue.
#[derive(Debug)]
struct Report {
    topology: Option<Topology>,
    models: Vec<(String, ModelStatus)>,
    issues: Vec<TopologyIssue>,
}

impl Report {
    fn failed(mut issues: Vec<TopologyIssue>, strict: bool) -> Report {
        harden(&mut issues, strict);
        Report {
            topology: None,
            models: Vec::new(),
            issues,
        }
    }

    /// Reads each model's config and runs the checks that need it.
    fn new(topology: Topology, strict: bool) -> Report {
        let mut issues = topology.warnings().to_vec();
        let mut models = Vec::new();
        for model in &topology.models {
            let status = if !model.path.exists() {
                let error = TopologyError::ModelMissing {
                    model: model.name.clone(),
                    path: model.path.display().to_string(),
                };
                issues.push(topology.model_issue(model, Severity::Warning, error));
                ModelStatus::Missing
            } else {
                match ModelConfig::from_path(&model.path) {
                    Ok(config) => {
                        let shape = shape_of(&config);
                        issues.extend(topology.check_model(&model.name, &shape));
                        ModelStatus::Shape(shape)
                    }
                    Err(e) => {
                        let error = TopologyError::ModelConfig {
                            model: model.name.clone(),
                            reason: e.to_string(),
                        };
                        issues.push(topology.model_issue(model, Severity::Error, error));
                        ModelStatus::Unreadable
                    }
                }
            };
            models.push((model.name.clone(), status));
        }
        harden(&mut issues, strict);
        issues.sort_by_key(|i| (i.location, i.severity));
        Report {
            topology: Some(topology),
            models,
            issues,
        }
    }

    fn ok(&self) -> bool {
        self.topology.is_some() && !self.issues.iter().any(TopologyIssue::is_error)
    }

    fn shape(&self, model: &str) -> Option<&ModelShape> {
        self.models.iter().find_map(|(name, status)| match status {
            ModelStatus::Shape(shape) if name == model => Some(shape),
            _ => None,
        })
    }

    /// `FILE:LINE: SEVERITY: MESSAGE`, then the change sentence, then a count.
    fn print_issues(&self, file: &Path, diag: &mut dyn Write) -> std::io::Result<()> {
        for issue in &self.issues {
            writeln!(diag, "{issue}")?;
            writeln!(diag, "  help: {}", issue.change())?;
        }
        let errors = self.issues.iter().filter(|i| i.is_error()).count();
        let warnings = self.issues.len() - errors;
        if errors > 0 {
            let warnings = match warnings {
                0 => String::new(),
                n => format!(" and {}", count(n, "warning")),
            };
            writeln!(
                diag,
                "{}: {}{warnings}; the topology cannot be used",
                file.display(),
                count(errors, "error"),
            )?;
        }
        Ok(())
    }

    fn json(&self, file: &Path) -> Value {
        let mut document = json!({
            "file": file,
            "ok": self.ok(),
            "issues": self.issues,
        });
        if let (true, Some(topology)) = (self.ok(), &self.topology) {
            document["coordinators"] = json!(topology.coordinators);
            document["hosts"] = json!(topology.hosts);
            document["models"] = topology
                .models
                .iter()
                .map(|m| {
                    let mut v = json!(m);
                    v["shape"] = json!(self.shape(&m.name));
                    v
                })
                .collect();
            document["groups"] = topology
                .groups
                .iter()
                .map(|g| group_json(g, self.shape(&g.model)))
                .collect();
        }
        document
    }
}

/// Under `--strict`, warnings become errors.
fn harden(issues: &mut [TopologyIssue], strict: bool) {
    if strict {
        for issue in issues {
            issue.severity = Severity::Error;
        }
    }
}

fn shape_of(config: &ModelConfig) -> ModelShape {
    ModelShape {
        num_attention_heads: config.num_attention_heads,
        num_key_value_heads: config.num_key_value_heads,
        intermediate_size: config.intermediate_size,
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
        num_hidden_layers: config.num_hidden_layers,
    }
}

/// The group with each shard's slice; slices are `null` when the model's shape is unknown.
fn group_json(group: &Group, shape: Option<&ModelShape>) -> Value {
    let plans = shape.and_then(|s| group.plan(s).ok());
    let mut value = json!(group);
    value["shards"] = group
        .shards
        .iter()
        .enumerate()
        .map(|(r, shard)| {
            let mut v = json!(shard);
            let plan = plans.as_ref().and_then(|p| p.get(r));
            v["heads"] = json!(plan.map(|p| &p.heads));
            v["kv_heads"] = json!(plan.map(|p| &p.kv_heads));
            v["kv_replicated"] = json!(plan.map(|p| p.kv_replicated));
            v["mlp_rows"] = json!(plan.map(|p| &p.mlp_rows));
            v["vocab_rows"] = json!(plan.map(|p| &p.vocab_rows));
            v
        })
        .collect();
    value
}

/// The plan as text: peers, then one table per group.
fn plan_text(file: &Path, topology: &Topology, models: &[(String, ModelStatus)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: ok — {}, {}, {}, {}",
        file.display(),
        count(topology.coordinators.len(), "coordinator peer"),
        count(topology.hosts.len(), "host"),
        count(topology.models.len(), "model"),
        count(topology.groups.len(), "group"),
    );
    let _ = writeln!(s, "\ncoordinators");
    let mut rows = vec![row(["id", "host", "quic", "http", "data_dir"])];
    for peer in &topology.coordinators {
        rows.push(vec![
            peer.id.to_string(),
            peer.host.clone(),
            peer.quic.to_string(),
            peer.http.to_string(),
            peer.data_dir.display().to_string(),
        ]);
    }
    s.push_str(&table(&rows));
    for group in &topology.groups {
        let status = models
            .iter()
            .find(|(name, _)| *name == group.model)
            .map(|(_, status)| status);
        s.push('\n');
        s.push_str(&group_text(group, topology, status));
    }
    s
}

fn group_text(group: &Group, topology: &Topology, status: Option<&ModelStatus>) -> String {
    let mut s = String::new();
    let auto = if group.requested_collective == CollectiveChoice::Auto {
        " (auto)"
    } else {
        ""
    };
    let _ = writeln!(
        s,
        "group {}: model {}, tp {}, collective {}{auto}",
        group.name, group.model, group.tp, group.collective
    );
    let shape = match status {
        Some(ModelStatus::Shape(shape)) => Some(shape),
        _ => None,
    };
    let plans = shape.and_then(|shape| group.plan(shape).ok());
    match shape {
        Some(shape) => {
            let _ = writeln!(
                s,
                "  model: {} heads, {} KV heads, intermediate {}, vocab {}, hidden {}, {} layers",
                shape.num_attention_heads,
                shape.num_key_value_heads,
                shape.intermediate_size,
                shape.vocab_size,
                shape.hidden_size,
                shape.num_hidden_layers
            );
        }
        None => {
            let path = topology
                .model(&group.model)
                .map_or_else(String::new, |m| m.path.display().to_string());
            let _ = writeln!(
                s,
                "  model files not found at {path}: heads and rows not computed"
            );
        }
    }
    s.push_str(&shard_table(group, plans.as_deref()));
    if let (Some(shape), Some(plans)) = (shape, &plans)
        && plans.iter().any(|r| r.kv_replicated)
    {
        let _ = writeln!(
            s,
            "  (copy): tp > num_key_value_heads, so each KV head is held by {} ranks",
            group.tp / shape.num_key_value_heads.max(1)
        );
    }
    s
}

/// One row per rank; slices are `-` when the model's shape is unknown.
fn shard_table(group: &Group, plans: Option<&[RankPlan]>) -> String {
    let mut rows = vec![row([
        "rank",
        "host",
        "device",
        "threads",
        "port",
        "kv_memory",
        "heads",
        "kv_heads",
        "mlp_rows",
        "vocab_rows",
    ])];
    for shard in &group.shards {
        let plan = plans.and_then(|p| p.get(shard.rank.0 as usize));
        let range = |f: fn(&RankPlan) -> String| plan.map_or_else(|| "-".to_owned(), f);
        rows.push(vec![
            shard.rank.to_string(),
            shard.host.clone(),
            shard.device.to_string(),
            shard.threads.to_string(),
            shard.port.to_string(),
            format_size(shard.kv_memory_bytes),
            range(|p| format!("{}..{}", p.heads.start, p.heads.end)),
            range(|p| {
                let copy = if p.kv_replicated { " (copy)" } else { "" };
                format!("{}..{}{copy}", p.kv_heads.start, p.kv_heads.end)
            }),
            range(|p| format!("{}..{}", p.mlp_rows.start, p.mlp_rows.end)),
            range(|p| format!("{}..{}", p.vocab_rows.start, p.vocab_rows.end)),
        ]);
    }
    table(&rows)
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|c| (*c).to_owned()).collect()
}

/// Left-aligned columns, two spaces apart, indented by two.
fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut s = String::new();
    for r in rows {
        let mut line = String::new();
        for (cell, width) in r.iter().zip(&widths) {
            let _ = write!(line, "  {cell:<width$}");
        }
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s
}

fn count(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}
