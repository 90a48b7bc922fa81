//! The topology file: one TOML file that describes a whole cluster (to be written).
