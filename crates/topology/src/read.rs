//! Reading a topology file from disk — the one piece of I/O in this crate, so that every
//! binary reports an unreadable or invalid file the same way: each issue with its line and
//! a sentence saying what to change.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::issue::TopologyIssue;
use crate::topology::Topology;

/// Why a topology file could not be used.
#[derive(Debug)]
pub enum ReadError {
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Invalid {
        path: PathBuf,
        /// Every issue found, errors and warnings, in file order.
        issues: Vec<TopologyIssue>,
    },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io { path, source } => {
                write!(f, "cannot read topology file {}: {source}", path.display())
            }
            ReadError::Invalid { path, issues } => {
                write!(f, "{} is not a valid topology:", path.display())?;
                for issue in issues {
                    write!(f, "\n{issue}\n  help: {}", issue.change())?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Io { source, .. } => Some(source),
            ReadError::Invalid { .. } => None,
        }
    }
}

impl Topology {
    /// Reads and validates the topology file at `path` (see [`Topology::parse`]).
    pub fn read(path: &Path) -> Result<Topology, ReadError> {
        let text = std::fs::read_to_string(path).map_err(|source| ReadError::Io {
            path: path.into(),
            source,
        })?;
        Topology::parse(&text, path).map_err(|issues| ReadError::Invalid {
            path: path.into(),
            issues,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_and_invalid_files_say_which_and_why() {
        let dir =
            std::env::temp_dir().join(format!("tessera-topology-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.toml");
        let err = Topology::read(&missing).unwrap_err();
        assert!(matches!(err, ReadError::Io { .. }));
        assert!(err.to_string().contains("missing.toml"), "{err}");
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "[[coordinator]]\nid = 0\n").unwrap();
        let err = Topology::read(&bad).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ReadError::Invalid { .. }));
        assert!(
            text.contains("bad.toml:") && text.contains("help:"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
