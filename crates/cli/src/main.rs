//! `tessera`: the command-line front end (to be written).

fn main() {}
