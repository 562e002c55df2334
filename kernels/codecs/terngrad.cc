// terngrad: being written (issue 3)
