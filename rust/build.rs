//! Build script: with the `python` feature, pyo3's interpreter cfgs (e.g. `Py_GIL_DISABLED` for a
//! free-threaded CPython), so the bindings can tell whether the GIL serialises their calls.

fn main() {
    // Rerun only when this script changes (pyo3's own lines add the interpreter's variables).
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "python")]
    pyo3_build_config::use_pyo3_cfgs();
}
