//! Where a problem is and how it is reported: [`Source`] is the file being read (its path,
//! text and the directory relative paths start from) and maps byte offsets to lines;
//! [`TopologyIssue`] is one problem with its place, severity and [`TopologyError`].

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::ser::SerializeStruct;

use crate::error::TopologyError;

/// A topology file's text with its path. No I/O: the caller has read the file.
#[derive(Clone, Debug)]
pub struct Source<'a> {
    path: &'a Path,
    text: &'a str,
    base_dir: PathBuf,
    /// Byte offset of the first character of every line.
    line_starts: Vec<usize>,
}

impl<'a> Source<'a> {
    /// `path` names the file in messages; relative paths inside it (model paths, data dirs)
    /// resolve against the directory of `path`.
    pub fn new(path: &'a Path, text: &'a str) -> Self {
        let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut line_starts = vec![0];
        line_starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Source {
            path,
            text,
            base_dir,
            line_starts,
        }
    }

    /// Resolves relative paths against `dir` instead of the file's directory.
    pub fn with_base_dir(mut self, dir: &Path) -> Self {
        self.base_dir = dir.to_path_buf();
        self
    }

    pub fn path(&self) -> &Path {
        self.path
    }

    pub fn text(&self) -> &str {
        self.text
    }

    pub fn base_dir(&self) -> &Path {
        &self.base_dir
    }

    /// Line and column (both from 1; the column counts characters) of a byte offset.
    pub fn locate(&self, offset: usize) -> Location {
        let offset = offset.min(self.text.len());
        let line_index = self.line_starts.partition_point(|&s| s <= offset) - 1;
        let start = self.line_starts[line_index];
        let column = self
            .text
            .get(start..offset)
            .map_or(offset - start, |s| s.chars().count())
            + 1;
        Location {
            line: line_index + 1,
            column,
        }
    }

    /// `relative` joined to the base directory; absolute paths are kept.
    pub(crate) fn resolve(&self, relative: &str) -> PathBuf {
        let path = Path::new(relative);
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.base_dir.join(path)
        }
    }

    pub(crate) fn issue(
        &self,
        severity: Severity,
        span: Range<usize>,
        field: impl Into<String>,
        error: TopologyError,
    ) -> TopologyIssue {
        TopologyIssue::new(
            severity,
            self.path.to_path_buf(),
            self.locate(span.start),
            field,
            error,
        )
    }
}

/// A place in the file; line and column count from 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

/// Errors stop a topology from being used; warnings do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        })
    }
}

/// One problem found in a topology file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyIssue {
    pub severity: Severity,
    /// The topology file, as given to [`Source::new`].
    pub file: PathBuf,
    pub location: Location,
    /// The key involved, as a path: `group[0].shard[2].port` (indices count entries of the
    /// same kind in file order, from 0).
    pub field: String,
    pub error: TopologyError,
}

impl TopologyIssue {
    pub fn new(
        severity: Severity,
        file: PathBuf,
        location: Location,
        field: impl Into<String>,
        error: TopologyError,
    ) -> Self {
        TopologyIssue {
            severity,
            file,
            location,
            field: field.into(),
            error,
        }
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// What is wrong, naming the values involved.
    pub fn message(&self) -> String {
        self.error.to_string()
    }

    /// One sentence that says what to change.
    pub fn change(&self) -> String {
        self.error.change()
    }

    /// A stable code for the kind of problem.
    pub fn class(&self) -> &'static str {
        self.error.class()
    }
}

/// `FILE:LINE: SEVERITY: MESSAGE`; the change sentence is [`TopologyIssue::change`].
impl fmt::Display for TopologyIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: {}",
            self.file.display(),
            self.location.line,
            self.severity,
            self.error
        )
    }
}

/// Serializes as `{severity, file, line, column, field, class, message, change}`.
impl Serialize for TopologyIssue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("TopologyIssue", 8)?;
        s.serialize_field("severity", &self.severity)?;
        s.serialize_field("file", &self.file)?;
        s.serialize_field("line", &self.location.line)?;
        s.serialize_field("column", &self.location.column)?;
        s.serialize_field("field", &self.field)?;
        s.serialize_field("class", self.class())?;
        s.serialize_field("message", &self.message())?;
        s.serialize_field("change", &self.change())?;
        s.end()
    }
}

/// Sorts issues by place in the file, errors before warnings on the same line.
pub(crate) fn sort_issues(issues: &mut [TopologyIssue]) {
    issues.sort_by(|a, b| {
        (a.location, a.severity, &a.field).cmp(&(b.location, b.severity, &b.field))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_counts_lines_and_characters_from_one() {
        let text = "a = 1\nbé = 2\n\nc";
        let source = Source::new(Path::new("x.toml"), text);
        assert_eq!(source.locate(0), Location { line: 1, column: 1 });
        assert_eq!(source.locate(4), Location { line: 1, column: 5 });
        assert_eq!(source.locate(6), Location { line: 2, column: 1 });
        // 'é' is two bytes: the '=' after "bé " is the fourth character.
        assert_eq!(source.locate(10), Location { line: 2, column: 4 });
        assert_eq!(source.locate(14), Location { line: 3, column: 1 });
        assert_eq!(source.locate(15), Location { line: 4, column: 1 });
        assert_eq!(source.locate(99), Location { line: 4, column: 2 });
    }

    #[test]
    fn relative_paths_start_at_the_file_directory() {
        let source = Source::new(Path::new("examples/demo.toml"), "");
        assert_eq!(
            source.resolve("../models/m.gguf"),
            Path::new("examples/../models/m.gguf")
        );
        assert_eq!(source.resolve("/abs/m"), Path::new("/abs/m"));
        let bare = Source::new(Path::new("demo.toml"), "");
        assert_eq!(bare.resolve("m"), Path::new("m"));
        let moved = bare.with_base_dir(Path::new("/etc/tessera"));
        assert_eq!(moved.resolve("m"), Path::new("/etc/tessera/m"));
    }

    #[test]
    fn display_is_file_line_severity_message() {
        let issue = TopologyIssue::new(
            Severity::Warning,
            PathBuf::from("t.toml"),
            Location { line: 7, column: 3 },
            "model[0]",
            TopologyError::UnusedModel { name: "m".into() },
        );
        assert_eq!(
            issue.to_string(),
            "t.toml:7: warning: model m is not served by any group"
        );
    }
}
