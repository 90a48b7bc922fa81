//! `tessera certs init --topology FILE --out DIR`: creates the cluster's private CA and one
//! certificate and key per coordinator peer and shard of the topology
//! ([`tessera_comm::certs::init_cluster`]), and says where each file went.
//!
//! `tessera certs issue --dir DIR --coordinator ID` (or `--shard GROUP/RANK`): one more
//! certificate from the CA in `DIR`, for a peer or shard added after `init`
//! ([`tessera_comm::certs::issue_one`]).
//!
//! Exit status: 0 when everything was written; 1 when the topology has errors (printed as
//! `tessera topology check` prints them) or the files cannot be written — an existing CA is
//! never overwritten.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use tessera_comm::certs::{CertsSummary, Identity, init_cluster, issue_one};
use tessera_topology::{PeerId, Rank, ReadError, Topology};

#[derive(Debug, clap::Args)]
pub struct InitArgs {
    /// The topology file: one certificate is made for each coordinator peer and each shard.
    #[arg(long, env = "TESSERA_TOPOLOGY")]
    pub topology: PathBuf,
    /// The directory to create the CA and certificates in (created with mode 0700; it must
    /// not hold a CA already).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct IssueArgs {
    /// The directory `tessera certs init` wrote (it holds `ca.pem` and `ca.key`).
    #[arg(long)]
    pub dir: PathBuf,
    /// A coordinator peer, by id (as `tessera cluster add --id` names it).
    #[arg(long, conflicts_with = "shard", required_unless_present = "shard")]
    pub coordinator: Option<u64>,
    /// A shard, as `GROUP/RANK`.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<(String, u32)>,
}

fn parse_shard(text: &str) -> Result<(String, u32), String> {
    let (group, rank) = text
        .rsplit_once('/')
        .ok_or_else(|| format!("`{text}` is not GROUP/RANK"))?;
    let rank = rank
        .parse()
        .map_err(|_| format!("`{rank}` is not a rank number"))?;
    if group.is_empty() {
        return Err(format!("`{text}` names no group"));
    }
    Ok((group.to_string(), rank))
}

/// Runs `certs issue`, saying where the files went.
pub fn issue(args: &IssueArgs) -> anyhow::Result<ExitCode> {
    let identity = match (&args.coordinator, &args.shard) {
        (Some(id), _) => Identity::Coordinator(PeerId(*id)),
        (None, Some((group, rank))) => Identity::Shard {
            group: group.clone(),
            rank: Rank(*rank),
        },
        (None, None) => anyhow::bail!("name the certificate's owner: --coordinator or --shard"),
    };
    let issued = issue_one(&args.dir, &identity)
        .with_context(|| format!("cannot issue a certificate in {}", args.dir.display()))?;
    writeln!(
        std::io::stdout().lock(),
        "{}: {} + {}  (key mode 0600); copy them with ca.pem to its host",
        issued.identity,
        issued.cert.display(),
        issued.key.display()
    )?;
    Ok(ExitCode::SUCCESS)
}

/// Runs `certs init`, printing to stdout and stderr.
pub fn init(args: &InitArgs) -> anyhow::Result<ExitCode> {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let ok = init_to(args, &mut stdout.lock(), &mut stderr.lock())?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs `certs init`, printing what was written to `out` and topology errors to `diag`.
/// Returns whether the certificates were written; `Err` when the topology cannot be read
/// or the certificates cannot be written.
pub fn init_to(args: &InitArgs, out: &mut dyn Write, diag: &mut dyn Write) -> anyhow::Result<bool> {
    let topology = match Topology::read(&args.topology) {
        Ok(topology) => topology,
        Err(error @ ReadError::Io { .. }) => return Err(error.into()),
        Err(ReadError::Invalid { issues, .. }) => {
            for issue in &issues {
                writeln!(diag, "{issue}")?;
                writeln!(diag, "  help: {}", issue.change())?;
            }
            writeln!(
                diag,
                "{}: the topology has errors; no certificates were made",
                args.topology.display()
            )?;
            return Ok(false);
        }
    };
    let summary = init_cluster(&topology, &args.out)
        .with_context(|| format!("cannot create certificates in {}", args.out.display()))?;
    write_summary(&summary, out)?;
    Ok(true)
}

fn write_summary(summary: &CertsSummary, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{}: {} and {} certificates, valid {} days",
        summary.dir.display(),
        summary.ca_name,
        summary.issued.len(),
        summary.validity_days,
    )?;
    writeln!(
        out,
        "  CA certificate  {}  (every host needs it)",
        summary.ca_cert.display()
    )?;
    writeln!(
        out,
        "  CA private key  {}  (mode 0600) SECRET: whoever holds it can join any process to \
         this cluster; keep it off the cluster's hosts",
        summary.ca_key.display()
    )?;
    let width = summary
        .issued
        .iter()
        .map(|issued| issued.identity.to_string().len())
        .max()
        .unwrap_or(0);
    for issued in &summary.issued {
        writeln!(
            out,
            "  {:<width$}  {} + {}  (key mode 0600)",
            issued.identity.to_string(),
            issued.cert.display(),
            issued.key.display(),
        )?;
    }
    writeln!(
        out,
        "copy to each host ca.pem and the .pem and .key of the processes it runs; to rotate, \
         run `tessera certs init` into a new directory and restart the cluster with it"
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOPOLOGY: &str = r#"
[[coordinator]]
id = 1
host = "local"
quic = "127.0.0.1:7000"
http = "127.0.0.1:8000"
data_dir = "run/c1"

[[host]]
name = "local"
address = "127.0.0.1"

[[model]]
name = "tiny"
path = "models/tiny"

[[group]]
name = "g0"
model = "tiny"
tp = 1

[[group.shard]]
rank = 0
host = "local"
device = "cpu"
port = 7101
kv_memory = "64MiB"
"#;

    #[test]
    fn init_writes_and_reports_every_file_then_refuses_a_second_run() {
        let dir = tempfile::tempdir().unwrap();
        let topology = dir.path().join("cluster.toml");
        std::fs::write(&topology, TOPOLOGY).unwrap();
        let args = InitArgs {
            topology,
            out: dir.path().join("certs"),
        };
        let (mut out, mut diag) = (Vec::new(), Vec::new());
        assert!(init_to(&args, &mut out, &mut diag).unwrap());
        let out = String::from_utf8(out).unwrap();
        for file in ["ca.pem", "ca.key", "coordinator-1.pem", "shard-g0-0.key"] {
            assert!(out.contains(file), "{out}");
            assert!(args.out.join(file).exists(), "{file}");
        }
        assert!(out.contains("SECRET"), "{out}");

        let err = init_to(&args, &mut Vec::new(), &mut Vec::new()).unwrap_err();
        assert!(format!("{err:#}").contains("already exists"), "{err:#}");
    }

    #[test]
    fn a_bad_topology_makes_no_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let topology = dir.path().join("cluster.toml");
        std::fs::write(&topology, "[[coordinator]]\nid = 0\n").unwrap();
        let args = InitArgs {
            topology,
            out: dir.path().join("certs"),
        };
        let mut diag = Vec::new();
        assert!(!init_to(&args, &mut Vec::new(), &mut diag).unwrap());
        assert!(String::from_utf8(diag).unwrap().contains("help:"));
        assert!(!args.out.exists());
    }

    #[test]
    fn issue_adds_one_certificate_from_the_existing_ca() {
        let dir = tempfile::tempdir().unwrap();
        let topology = dir.path().join("cluster.toml");
        std::fs::write(&topology, TOPOLOGY).unwrap();
        let out = dir.path().join("certs");
        let init = InitArgs {
            topology,
            out: out.clone(),
        };
        assert!(init_to(&init, &mut Vec::new(), &mut Vec::new()).unwrap());
        let args = IssueArgs {
            dir: out.clone(),
            coordinator: None,
            shard: Some(parse_shard("g0/5").unwrap()),
        };
        issue(&args).unwrap();
        assert!(out.join("shard-g0-5.pem").exists());
        assert!(out.join("shard-g0-5.key").exists());
        assert!(issue(&args).is_err(), "never overwritten");
        assert!(parse_shard("g0").is_err());
        assert!(parse_shard("/1").is_err());
        assert!(parse_shard("g0/x").is_err());
    }
}
