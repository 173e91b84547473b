//! PyO3 glue: argument conversion, calls into the core, result conversion. No logic lives here.

mod convert;
mod errors;
mod hashing;
mod manager;
mod pool;
mod request;
mod running;
mod timing;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(convert::_int_layout, m)?)?;
    errors::register(m)?;
    pool::register(m)?;
    hashing::register(m)?;
    manager::register(m)?;
    running::register(m)?;
    timing::register(m)?;
    Ok(())
}
