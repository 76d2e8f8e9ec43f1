//! q
fn main() {}
