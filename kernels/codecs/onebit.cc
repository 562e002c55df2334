// onebit: being written (issue 3)
