#pragma once
// STUB: being written.
